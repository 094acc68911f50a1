"""n > 1 at TP=2 (CPU, gloo): every rank makes the same samples and forks the same prompt
pages (the cross-rank check compares every pool's terms after every step), the greedy samples
equal TP=1's, memory whole on every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts

from .closeness import assert_greedy_close


class TestTensorParallelNSamples(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_tp2_samples(self, tp_models: Callable[[str], Path], overlap: bool) -> None:
        model_dir = tp_models("llama")
        prompts = random_prompts(2, 256, 20, 40, seed=5)
        sp = SamplingParams(max_new_tokens=10, ignore_eos=True, n=3)
        with self.engine(model=str(model_dir), page_size=4, overlap=overlap) as one:
            expected = [r.token_ids for r in one.generate(prompts, sp)]
        with self.engine(model=str(model_dir), tp_size=2, page_size=4,
                         overlap=overlap) as engine:
            results = engine.generate(prompts, sp)
            prefill = engine.stats()["prefill_tokens"]
            self.assert_idle_memory_whole(engine)
            checks = engine.hook_pm.get_plugins()
            assert any(type(p).__name__ == "CrossRankCheck" and p.checks > 0 for p in checks)
        for res, want, prompt in zip(results, expected, prompts, strict=True):
            assert len(res.samples) == 3
            for s in res.samples:
                assert_greedy_close(model_dir, [prompt], [s.token_ids], [want], "tp2 n=3")
        # The samples forked the prompt on rank 0 (and, by the cross-rank check, on rank 1).
        assert prefill == sum(len(p) + 2 * (len(p) - (len(p) - 1) // 4 * 4) for p in prompts)
