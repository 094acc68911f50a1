"""One request's unusable logits (NaN, +inf) cost that request a token, never the batch: the
sampler reports an error for its row and samples every other row as usual."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from plugserve.runner.model_runner import ModelRunner
from plugserve.runner.sampler import PLACEHOLDER_TOKEN, sample, sampling_probs
from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.step import PreparedStep

VOCAB = 32


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gens(n: int) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(100 + i) for i in range(n)]


GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.01)


@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_nan_row_gets_an_error_and_the_others_tokens(sp: SamplingParams) -> None:
    logits = _logits(3)
    logits[1, 5] = float("nan")
    out = sample(logits, [sp] * 3, _gens(3), want_logprobs=True)
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1] is not None and "NaN" in out.errors[1], out.errors
    assert out.any_error
    assert out.ids[1] == PLACEHOLDER_TOKEN
    # The good rows get exactly what they get in a batch without the bad row.
    good = logits[[0, 2]]
    gens = _gens(3)
    alone = sample(good, [sp] * 2, [gens[0], gens[2]], want_logprobs=True)
    assert [out.ids[0], out.ids[2]] == alone.ids
    assert alone.errors == [None, None] and not alone.any_error
    assert out.logprobs is not None and alone.logprobs is not None
    assert [out.logprobs[0], out.logprobs[2]] == alone.logprobs
    assert out.logprobs[1] == 0.0


def test_mixed_batch_greedy_and_sampled_rows() -> None:
    logits = _logits(4, seed=1)
    logits[0] = float("nan")  # a sampled request with NaN logits
    logits[3, 0] = float("inf")  # a greedy request with an overflowed logit
    params = [SAMPLED, GREEDY, SAMPLED, GREEDY]
    out = sample(logits, params, _gens(4), want_logprobs=False)
    assert out.errors[1] is None and out.errors[2] is None
    assert out.errors[0] is not None and out.errors[3] is not None
    assert "+inf" in out.errors[3]
    assert out.ids[1] == int(torch.argmax(logits[1]))
    assert 0 <= out.ids[2] < VOCAB
    assert out.logprobs is None


def test_masked_logits_are_fine_but_all_masked_is_an_error() -> None:
    logits = _logits(2, seed=2)
    logits[0, :10] = float("-inf")  # some tokens masked: a usable row
    logits[1] = float("-inf")  # nothing left to pick
    for sp in (GREEDY, SAMPLED):
        out = sample(logits, [sp, sp], _gens(2), want_logprobs=True)
        assert out.errors[0] is None and out.ids[0] >= 10
        assert out.errors[1] is not None
        assert out.logprobs is not None and math.isfinite(out.logprobs[0])


def test_temperature_overflow_in_the_sampler_is_a_row_error() -> None:
    # Rejected at submit by SamplingParams.problems; should such params reach the sampler
    # anyway, the row fails on its own (1e-45 overflows logits / temperature to inf).
    logits = _logits(2, seed=3)
    tiny = SamplingParams(temperature=1e-45)
    nan = SamplingParams(temperature=float("nan"))
    out = sample(logits, [tiny, SAMPLED], _gens(2), want_logprobs=False)
    assert out.errors[0] is not None and "non-finite probabilities" in out.errors[0]
    assert out.errors[1] is None
    out = sample(logits, [SAMPLED, nan], _gens(2), want_logprobs=False)
    assert out.errors[0] is None and out.errors[1] is not None


def test_sampling_probs_unchanged() -> None:
    row = _logits(1, seed=4)[0]
    p = SamplingParams(temperature=0.7, top_k=5)
    probs = torch.softmax(row / 0.7, dim=-1)
    kth = torch.topk(probs, 5).values[-1]
    probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    torch.testing.assert_close(sampling_probs(row, p), probs / probs.sum())


class _FakeModel:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, fb: Any, backend: Any) -> Any:
        return SimpleNamespace(logits=self.logits)


def test_model_runner_reports_errors_per_request_of_the_batch() -> None:
    # Three requests in the batch; rows 0 and 2 are sampled (row 1 is a prefill chunk) and
    # the logits of request 2 are NaN.
    logits = _logits(2, seed=5)
    logits[1] = float("nan")
    backend: Any = SimpleNamespace(init_forward_metadata=lambda fb: None)
    nothing: Any = None  # the pools: unused by a forward whose model is faked
    runner = ModelRunner(_FakeModel(logits), backend, nothing, nothing, 64, torch.device("cpu"))
    fb: Any = SimpleNamespace(input_ids=torch.tensor([1, 2, 3]), mode=ForwardMode.EXTEND)
    reqs: Any = [object(), object(), object()]
    step = PreparedStep(
        reqs=reqs,
        sample_mask=[True, False, True],
        future_refs=[7, 8, 9],
        forward_batch=fb,
        sample_rows=[0, 2],
        params=[SAMPLED, GREEDY],
        generators=_gens(2),
        want_logprobs=False,
    )
    out = runner.run(step)
    assert out.errors is not None
    assert out.errors[0] is None and out.errors[1] is None
    assert out.errors[2] is not None and "NaN" in out.errors[2]
    assert out.next_token_ids[1] == -1  # not sampled
    assert 0 <= out.next_token_ids[0] < VOCAB
    assert out.next_token_ids[2] == PLACEHOLDER_TOKEN
    # The future buffer holds a valid id for the failed request (an overlap forward may read
    # it before the scheduler finishes the request).
    assert int(runner.future_tokens[9]) == PLACEHOLDER_TOKEN

    logits[1] = 0.0  # a clean step reports no errors at all
    assert runner.run(step).errors is None
