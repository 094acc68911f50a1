"""The Triton backend on a hybrid sliding-window model with its own SWA pool: windowed
layers read translated slots (one translated index table per batch), greedy output is
token-identical to transformers fp32, and SWA pages are freed out of the window."""

from __future__ import annotations

from pathlib import Path

import torch

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir


class TestTritonSWAPools(EngineTest):
    def test_hybrid_model_matches_transformers(
        self, tmp_path: Path, kernel_device: torch.device
    ) -> None:
        model_dir = make_tiny_model_dir(tmp_path / "qwen2_swa", arch="qwen2_swa", seed=2,
                                        sliding_window=12)
        prompts = random_prompts(2, 256, 30, 40, seed=5)
        max_new = [30, 20]
        expected = hf_greedy(model_dir, prompts, max_new)
        sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]
        with self.engine(model=str(model_dir), attention="triton", device=str(kernel_device),
                         page_size=4, chunked_prefill_size=16, overlap=True) as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            results = engine.generate(prompts, sampling)
            assert [r.token_ids for r in results] == expected
            assert engine.kv.swa_window is not None and engine.kv.swa_window.freed_slots > 0
            self.assert_idle_memory_whole(engine)
