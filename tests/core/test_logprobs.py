"""Logprobs against transformers' log_softmax (fp32, within 1e-4): each output token's logprob
and top alternatives, each prompt token's (prompt_logprobs), with and without a prefix-cache
hit, chunked prefill, under the normal and the overlap loop, the checker on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts

TOL = 1e-4


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row j is the log-softmax predicting token j + 1."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(result: Any, ids: list[int], ref: torch.Tensor, top_n: int) -> None:
    assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        expected = float(ref[j - 1, ids[j]])
        assert result.prompt_logprobs[j] == pytest.approx(expected, abs=TOL), j
        top = result.prompt_top_logprobs[j]
        assert len(top) == top_n
        values, tokens = ref[j - 1].topk(top_n)
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=TOL)
        # Ties aside, the same tokens in the same order.
        assert [t for t, _ in top][:1] == tokens.tolist()[:1]


@pytest.mark.parametrize("overlap", [False, True])
class TestLogprobsMatchTransformers(EngineTest):
    def test_output_and_prompt_logprobs(self, tiny_model_dir: Path, overlap: bool) -> None:
        prompts = random_prompts(3, 256, 20, 70, seed=4)
        # Prompt 1 repeats prompt 0's first 48 tokens: a prefix-cache hit on the second call.
        prompts[1] = prompts[0][:48] + prompts[1][:10]
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3,
                            prompt_logprobs=2)
        with self.engine(model=str(tiny_model_dir), page_size=4, chunked_prefill_size=16,
                         overlap=overlap) as engine:
            first = engine.generate(prompts[:1], sp)  # caches prompt 0
            plain = engine.generate(prompts[1:2], SamplingParams(max_new_tokens=2))
            assert plain[0].stats["cached_tokens"] >= 16  # the cache holds prompt 0's prefix
            rest = engine.generate(prompts[1:], sp)
            self.assert_idle_memory_whole(engine)
        for result, ids in zip(first + rest, [prompts[0], *prompts[1:]], strict=True):
            full = ids + result.token_ids
            ref = hf_logprobs(tiny_model_dir, full)
            check_prompt_logprobs(result, ids, ref, 2)
            assert result.stats["cached_tokens"] == 0  # prompt logprobs read no cache
            for k, token in enumerate(result.token_ids):
                row = ref[len(ids) - 1 + k]
                assert token == int(row.argmax())
                assert result.logprobs[k] == pytest.approx(float(row[token]), abs=TOL)
                top = result.top_logprobs[k]
                assert top[0][0] == token
                assert top[0][1] == result.logprobs[k]  # one log-softmax for both
                assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(),
                                                            abs=TOL)

    def test_logprobs_ignore_logits_steps(self, tiny_model_dir: Path, overlap: bool) -> None:
        """A logit bias changes the token chosen, not the logprobs reported (the model's)."""
        ids = random_prompts(1, 256, 12, 12, seed=9)[0]
        ref = hf_logprobs(tiny_model_dir, ids)
        forced = int(ref[-1].argmin())
        sp = SamplingParams(max_new_tokens=1, logprobs=True, logit_bias={forced: 100.0})
        with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
            (out,) = engine.generate([ids], sp)
            self.assert_idle_memory_whole(engine)
        assert out.token_ids == [forced]
        assert out.logprobs[0] == pytest.approx(float(ref[-1, forced]), abs=TOL)
