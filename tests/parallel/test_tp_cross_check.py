"""The cross-rank check catches one rank's accounting drifting from rank 0's, at that step.

Fix toggle `tp_rank1_skips_free` makes rank 1 skip its first free of KV pages. Run without
it, the same workload passes, and rank 0's first free tells at which step the toggle will
strike; with it, every rank stops after exactly that step with an error naming rank 1, the
pool and its terms (before rank 1's own checker could call it a plain leak).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.parallel.cross_check import TP_RANK1_SKIPS_FREE, CrossRankMismatchError, mismatch
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts

SETTINGS: dict[str, Any] = {"page_size": 4, "kv_pool_tokens": 512}


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(4, 256, 5, 30, seed=2)
    return prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9, 6, 12)]


class TestCrossRankCheck(EngineTest):
    def test_rank1_skipping_a_free_is_caught_at_that_step(
        self, tp_models: Callable[[str], Path]
    ) -> None:
        model = str(tp_models("llama"))
        prompts, sampling = _workload()
        with self.engine(model=model, tp_size=2, **SETTINGS) as engine:
            first_free: list[int] = []
            free_slots = engine.kv.allocator.free_slots

            def watched(slots: Any) -> None:  # rank 0's frees: the step each happens in
                if len(slots) and not first_free:
                    first_free.append(int(engine.scheduler.stats["steps"]) + 1)
                free_slots(slots)

            engine.kv.allocator.free_slots = watched  # type: ignore[method-assign]
            engine.generate(prompts, sampling)  # without the toggle: every check passes
            self.assert_idle_memory_whole(engine)
        assert first_free, "the workload was meant to free pages"
        with self.engine(model=model, tp_size=2, revert_fixes={TP_RANK1_SKIPS_FREE},
                         **SETTINGS) as engine:
            with pytest.raises(CrossRankMismatchError) as caught:
                engine.generate(prompts, sampling)
        message = str(caught.value)
        assert f"rank 1 differs from rank 0's after step {first_free[0]} (busy)" in message
        assert "pool 'full': available" in message
        assert "rank 1: available=" in message and "rank 0: available=" in message


def test_mismatch_names_rank_pool_and_terms() -> None:
    import torch

    same = torch.tensor([5, 10, 2, 0, 0, 4, 16, 3, 1, 0, 0, 0, 4])
    drifted = torch.tensor([5, 8, 2, 0, 0, 4, 16, 3, 1, 0, 0, 0, 4])
    assert mismatch([same, same.clone()], ["full", "swa"], "busy") is None
    text = mismatch([same, same.clone(), drifted], ["full", "swa"], "busy")
    assert text is not None
    assert "rank 2 differs from rank 0's after step 5 (busy)" in text
    assert "pool 'full': available 8 (rank 0: 10)" in text and "swa" not in text
    late = torch.tensor([6, *same.tolist()[1:]])
    assert "rank 1 is at step 6 but rank 0 at step 5" in str(mismatch([same, late], ["full",
                                                                                      "swa"],
                                                                       "idle"))
