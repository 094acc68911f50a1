"""Sampling: the batched logits steps, then greedy or random choice, then logprobs.

One forward's sampled rows go through an ordered list of batched *logits steps*, each applied
at once to the rows whose parameters ask for it (`plugserve.runner.logits_steps`: logit bias,
min_tokens, the repetition / frequency / presence penalties; a grammar mask is one more step
in the same list). Then greedy rows take the argmax and the others are sampled with
temperature, top-k, min-p, top-p and their own seed. Logprobs (the sampled token's and the
top alternatives) are the model's log-softmax *before* any step, as vLLM returns them.

One request's numbers never take the batch down: a row whose logits or probabilities are not
usable (NaN, +inf, nothing left with non-zero probability) gets an error message instead of a
token, and every other row is sampled as usual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plugserve.kernels import row_argmax
from plugserve.runner.logits_steps import LogitsStep, SampleRows, TokenHistory, default_steps
from plugserve.sampling import SamplingParams

__all__ = ["PLACEHOLDER_TOKEN", "SampleRows", "Sampled", "Sampler", "sample", "sampling_probs"]

# The token id reported for a row that failed (a valid id, so a consumer that reads it before
# seeing the error, e.g. an overlap forward through the future buffer, still runs).
PLACEHOLDER_TOKEN = 0

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Sampled:
    ids: list[int]  # per row; PLACEHOLDER_TOKEN where errors[i] is set
    logprobs: list[float] | None  # per row when asked for; 0.0 where errors[i] is set
    errors: list[str | None]  # per row: None = sampled, else why no token was sampled
    # Per row, when any row asked for top logprobs: that row's N most likely tokens (None for
    # the rows that did not ask, or failed).
    top_logprobs: list[TopLogprobs | None] | None = None

    @property
    def any_error(self) -> bool:
        return any(e is not None for e in self.errors)


class Sampler:
    """The sampler of one engine: its logits steps and the per-row token history the penalty
    step keeps on the device."""

    def __init__(self, num_rows: int, device: torch.device | str,
                 eos_token_ids: frozenset[int] = frozenset(),
                 steps: Sequence[LogitsStep] | None = None) -> None:
        self.history = TokenHistory(num_rows, device)
        self.steps: list[LogitsStep] = list(
            steps if steps is not None else default_steps(self.history, eos_token_ids))

    def sample(self, logits: torch.Tensor, rows: SampleRows, want_logprobs: bool) -> Sampled:
        """logits: [n, vocab] float32, one row per sampled request. Never raises for one row's
        values: such a row gets an entry in `errors`."""
        params = rows.params
        n = logits.shape[0]
        errors: list[str | None] = [None] * n
        row_max, greedy_ids = _argmax(logits)
        for i, value in enumerate(row_max.tolist()):
            if not math.isfinite(value):
                errors[i] = _bad_logits_message(logits[i])
        # The logits steps work on a copy: logprobs are read from the model's own logits.
        chosen_from = logits
        applied = [(step, idx) for step in self.steps
                   if (idx := [i for i, p in enumerate(params)
                               if errors[i] is None and step.applies(p)])]
        if applied:
            chosen_from = logits.clone()
            for step, idx in applied:
                step.apply(chosen_from, idx, rows)
            row_max, greedy_ids = _argmax(chosen_from)
            for i, value in enumerate(row_max.tolist()):
                if errors[i] is None and not math.isfinite(value):
                    errors[i] = (f"no token is left to sample after the logits steps "
                                 f"({', '.join(params[i].decode_time_fields())}); no token "
                                 "was sampled")
        if all(p.greedy for p in params):
            ids = greedy_ids
        else:
            ids = greedy_ids.clone()
            for i, p in enumerate(params):
                if not p.greedy and errors[i] is None:
                    token, errors[i] = _sample_row(chosen_from[i], p, rows.generators[i])
                    ids[i] = token
        bad = [i for i, e in enumerate(errors) if e is not None]
        if bad:
            ids[bad] = PLACEHOLDER_TOKEN
        logprobs, top = _logprobs(logits, ids, params, bad, want_logprobs)
        for step, idx in applied:
            step.after_sample(ids, [i for i in idx if errors[i] is None], rows)
        return Sampled(ids.tolist(), logprobs, errors, top)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    want_logprobs: bool,
) -> Sampled:
    """One batch sampled by a sampler of its own (no token history: a penalty sees a fresh
    request)."""
    sampler = Sampler(len(params), logits.device)
    return sampler.sample(logits, SampleRows.plain(params, generators), want_logprobs)


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and its index. A row's max is NaN when the row holds a NaN (max
    propagates it), +inf with a +inf, -inf when nothing is finite."""
    if row_argmax.applies(logits):  # torch.max's result, without its one-value-at-a-time loop
        return row_argmax.row_argmax(logits)
    values, ids = torch.max(logits, dim=-1)
    return values, ids


def _logprobs(
    logits: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams], bad: list[int],
    want_logprobs: bool,
) -> tuple[list[float] | None, list[TopLogprobs | None] | None]:
    """The sampled tokens' logprobs and, for rows that asked, the top alternatives: both read
    from one log-softmax, so a token that is its row's argmax has exactly the top value."""
    if not want_logprobs:
        return None, None
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    for i in bad:
        logprobs[i] = 0.0
    wanted = [i for i, p in enumerate(params) if p.top_logprobs > 0 and i not in bad]
    if not wanted:
        return logprobs, None
    k = max(params[i].top_logprobs for i in wanted)
    values, tokens = logp[wanted].topk(k, dim=-1)
    top: list[TopLogprobs | None] = [None] * len(params)
    for row, vals, toks in zip(wanted, values.tolist(), tokens.tolist(), strict=True):
        count = params[row].top_logprobs
        top[row] = list(zip(toks[:count], vals[:count], strict=True))
    return logprobs, top


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
