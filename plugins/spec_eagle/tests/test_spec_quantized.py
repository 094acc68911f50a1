"""EAGLE over a target quantized on load (`quantization="q8_0"`): the head is quantized
too, its draft LM head reads the target's (dequantized) head rows, and greedy output with
speculation equals greedy output without it, with the checker at level 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PROMPTS, greedy
from plugserve.testing import EngineTest


class TestEagleOverQuantizedTarget(EngineTest):
    @pytest.mark.parametrize("topk", [1, 2])
    def test_lossless_with_a_quantized_head(self, target_dir: Path, trained_head_dir: Path,
                                            topk: int) -> None:
        quant = {"quantization": "q8_0", "quant_activations": "float"}
        with self.engine(model=str(target_dir), **quant) as plain:
            reference = [r.token_ids for r in plain.generate(PROMPTS, greedy())]
        with self.engine(model=str(target_dir), spec="eagle", draft_model=str(trained_head_dir),
                         spec_steps=3, spec_topk=topk, page_size=4, **quant) as engine:
            results = engine.generate(PROMPTS, greedy())
            assert [r.token_ids for r in results] == reference
            self.assert_idle_memory_whole(engine)
            head = engine.spec.drafter.head  # type: ignore[union-attr]
            assert head.fc.quant is not None and head.layer.self_attn.qkv_proj.quant is not None
            assert sum(r.stats.get("spec_accepted_tokens", 0) for r in results) > 0
