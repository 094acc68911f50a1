"""The sampler's logits steps against a reference greedy loop over transformers' logits with
vLLM's formulas: repetition / frequency / presence penalties, logit bias and min_tokens, batched
with requests that use none of them, under the normal and the overlap loop and through
retracts (a small KV pool), the checker on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts


def reference_greedy(model_dir: Path, ids: list[int], sp: SamplingParams,
                     eos: frozenset[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(sp.max_new_tokens):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float().clone()
            for token, bias in sp.logit_bias.items():
                logits[token] += bias
            if len(out) < sp.min_tokens:
                for token in set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos)):
                    logits[token] = float("-inf")
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                    minlength=logits.shape[0]) if out else \
                torch.zeros_like(logits, dtype=torch.int64)
            seen = counts > 0
            in_prompt = torch.zeros_like(seen)
            in_prompt[torch.tensor(ids)] = True
            rp = sp.repetition_penalty
            hit = seen | in_prompt
            logits = torch.where(hit, torch.where(logits > 0, logits / rp, logits * rp), logits)
            logits -= sp.frequency_penalty * counts.float()
            logits -= sp.presence_penalty * seen.float()
            token = int(logits.argmax())
            out.append(token)
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos):
                break
    return out


CASES = [
    SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=2.0,
                   repetition_penalty=0.7),
    SamplingParams(max_new_tokens=24, ignore_eos=True),  # no step: batched beside the others
]


@pytest.mark.parametrize("overlap", [False, True])
class TestLogitsSteps(EngineTest):
    def test_penalties_match_reference(self, tiny_model_dir: Path, overlap: bool) -> None:
        prompts = random_prompts(len(CASES) * 2, 256, 6, 30, seed=11)
        params = CASES * 2
        # A KV pool this small makes the decodes retract and re-prefill (the token history
        # is rebuilt then).
        with self.engine(model=str(tiny_model_dir), page_size=4, kv_pool_tokens=256,
                         max_running_requests=8, overlap=overlap) as engine:
            eos = engine.tokenizer.eos_token_ids
            out = engine.generate(prompts, params)
            retracted = engine.stats().get("retracted_reqs", 0)
            self.assert_idle_memory_whole(engine)
        assert retracted > 0
        for result, ids, sp in zip(out, prompts, params, strict=True):
            assert result.error is None
            assert result.token_ids == reference_greedy(tiny_model_dir, ids, sp, eos)
        # The penalties changed something: unpenalized continuations repeat tokens.
        assert out[0].token_ids != out[3].token_ids or prompts[0] != prompts[3]

    def test_bias_and_min_tokens(self, tiny_model_dir: Path, overlap: bool) -> None:
        ids = random_prompts(1, 256, 10, 10, seed=5)[0]
        with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
            eos = engine.tokenizer.eos_token_ids
            free = engine.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))
            stop_at = free[0].token_ids[2]
            stopped = SamplingParams(max_new_tokens=8, stop_token_ids=(stop_at,))
            held = SamplingParams(max_new_tokens=8, stop_token_ids=(stop_at,), min_tokens=6,
                                  logit_bias={5: 3.0, 77: -2.5})
            out = engine.generate([ids, ids], [stopped, held])
            self.assert_idle_memory_whole(engine)
        assert out[0].token_ids[-1] == stop_at and len(out[0].token_ids) <= 3
        assert out[1].token_ids == reference_greedy(tiny_model_dir, ids, held, eos)
        assert len(out[1].token_ids) >= 6
        assert stop_at not in out[1].token_ids[:6]


def test_spec_refuses_decode_time_fields() -> None:
    """Speculative rounds verify drafts without the logits steps: such a request is refused
    with the fields named, not served differently."""
    sp = SamplingParams(presence_penalty=1.0, top_logprobs=2, logprobs=True)
    assert sp.decode_time_fields() == ["top_logprobs", "presence_penalty"]
    assert SamplingParams().decode_time_fields() == []


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number"),
    ({"logit_bias": {999: 1.0}}, "logit_bias has token ids outside the vocabulary"),
    ({"logit_bias": {3: 101.0}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"min_tokens": 20, "max_new_tokens": 8}, "min_tokens (20) must not exceed"),
    ({"top_logprobs": 2}, "top_logprobs=2 needs logprobs=True"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be None or an int in [0, 256]"),
])
def test_sampling_field_problems(kwargs: dict[str, Any], words: str) -> None:
    problems = SamplingParams(**kwargs).problems(256)
    assert any(words in p for p in problems), problems
