"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One request's numbers never take the batch down: a row whose logits or probabilities are not
usable (NaN, +inf, nothing left with non-zero probability) gets an error message instead of a
token, and every other row is sampled as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plugserve.kernels import row_argmax
from plugserve.sampling import SamplingParams

# The token id reported for a row that failed (a valid id, so a consumer that reads it before
# seeing the error, e.g. an overlap forward through the future buffer, still runs).
PLACEHOLDER_TOKEN = 0


@dataclass
class Sampled:
    ids: list[int]  # per row; PLACEHOLDER_TOKEN where errors[i] is set
    logprobs: list[float] | None  # per row when asked for; 0.0 where errors[i] is set
    errors: list[str | None]  # per row: None = sampled, else why no token was sampled

    @property
    def any_error(self) -> bool:
        return any(e is not None for e in self.errors)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    want_logprobs: bool,
) -> Sampled:
    """logits: [n, vocab] float32, one row per sampled request. Never raises for one row's
    values: such a row gets an entry in `errors`."""
    n = logits.shape[0]
    errors: list[str | None] = [None] * n
    # Unusable logits (the model overflowed): NaN or +inf anywhere, or no finite value at all.
    # -inf alone is fine (a masked token). One pass finds both: a row's max is NaN when the row
    # holds a NaN (max propagates it), +inf with a +inf, -inf when nothing is finite.
    if row_argmax.applies(logits):  # torch.max's result, without its one-value-at-a-time loop
        row_max, greedy_ids = row_argmax.row_argmax(logits)
    else:
        row_max, greedy_ids = torch.max(logits, dim=-1)
    for i, value in enumerate(row_max.tolist()):
        if not math.isfinite(value):
            errors[i] = _bad_logits_message(logits[i])
    if all(p.greedy for p in params):
        ids = greedy_ids
    else:
        ids = greedy_ids.clone()
        for i, p in enumerate(params):
            if not p.greedy and errors[i] is None:
                token, errors[i] = _sample_row(logits[i], p, generators[i])
                ids[i] = token
    bad = [i for i, e in enumerate(errors) if e is not None]
    if bad:
        ids[bad] = PLACEHOLDER_TOKEN
    logprobs = None
    if want_logprobs:
        logp = torch.log_softmax(logits.float(), dim=-1)
        logprobs = logp.gather(1, ids[:, None]).squeeze(1).tolist()
        for i in bad:
            logprobs[i] = 0.0
    return Sampled(ids.tolist(), logprobs, errors)


def _bad_logits_message(row: torch.Tensor) -> str:
    nan = int(torch.isnan(row).sum())
    pos_inf = int(torch.isposinf(row).sum())
    neg_inf = int(torch.isneginf(row).sum())
    return (
        f"the model produced unusable logits for this request ({nan} NaN, {pos_inf} +inf, "
        f"{neg_inf} -inf of {row.shape[0]}); no token was sampled"
    )


def _sample_row(
    row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
) -> tuple[int, str | None]:
    """(token, None), or (PLACEHOLDER_TOKEN, why) when this row cannot be sampled."""
    settings = f"temperature={p.temperature}, top_k={p.top_k}, top_p={p.top_p}, min_p={p.min_p}"
    try:
        probs = _filtered_probs(row, p)
        mass = probs.sum()
        total = float(mass)
        if not (bool(torch.isfinite(probs).all()) and math.isfinite(total)):
            return PLACEHOLDER_TOKEN, (
                f"sampling produced non-finite probabilities ({settings}); no token was sampled"
            )
        if total <= 0:
            return PLACEHOLDER_TOKEN, (
                f"no token has a non-zero probability ({settings}); no token was sampled"
            )
        return int(torch.multinomial((probs / mass).cpu(), 1, generator=gen).item()), None
    except Exception as exc:  # one request's failure must not lose the batch
        return PLACEHOLDER_TOKEN, f"sampling failed ({settings}): {exc}"


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p: the kept probabilities, not renormalised."""
    probs = torch.softmax(row.float() / p.temperature, dim=-1)
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= p.top_p * cumulative[-1]
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, min-p and
    top-p, renormalised. Speculative sampling accepts draft tokens against it."""
    probs = _filtered_probs(row, p)
    return probs / probs.sum()
