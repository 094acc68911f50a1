"""One request's unusable numbers end that request with an error; the batch, the engine and
the KV accounting go on, under the normal and the overlap loop (where a decode for the
failed request is already in flight when its error is known)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


class TestNanLogits(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_one_request_fails_the_others_are_served(
        self, tiny_model_dir: Path, overlap: bool, page_size: int
    ) -> None:
        prompts = [[5, 6, 7], [8, 9, 10], [11, 12]]
        sampled = SamplingParams(max_new_tokens=4, temperature=0.7, seed=1, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir), overlap=overlap,
                         page_size=page_size) as engine:
            expected = engine.generate(prompts, [GREEDY, sampled, GREEDY])
            model = engine.runner.model
            forwards = [0]

            def nan_in_second_forward(fb: Any, backend: Any) -> Any:
                out = model(fb, backend)
                forwards[0] += 1
                if forwards[0] == 2:
                    out.logits[1] = float("nan")  # the second request's first decode
                return out

            engine.runner.model = nan_in_second_forward
            out = engine.generate(prompts, [GREEDY, sampled, GREEDY])
            assert out[1].finish_reason == "error"
            assert "unusable logits" in (out[1].error or "")
            assert out[1].token_ids == expected[1].token_ids[:1]
            assert [out[0].token_ids, out[2].token_ids] == [expected[0].token_ids,
                                                            expected[2].token_ids]
            self.assert_idle_memory_whole(engine)
            engine.runner.model = model
            assert engine.generate(prompts[:1], GREEDY)[0].token_ids == expected[0].token_ids
