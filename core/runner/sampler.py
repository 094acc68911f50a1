"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from plugserve.sampling import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    want_logprobs: bool,
) -> tuple[list[int], list[float] | None]:
    """logits: [n, vocab] float32, one row per sampled request."""
    greedy_ids = torch.argmax(logits, dim=-1)
    if all(p.greedy for p in params):
        ids = greedy_ids
    else:
        ids = greedy_ids.clone()
        for i, p in enumerate(params):
            if not p.greedy:
                ids[i] = _sample_row(logits[i], p, generators[i])
    logprobs = None
    if want_logprobs:
        logp = torch.log_softmax(logits.float(), dim=-1)
        logprobs = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    return ids.tolist(), logprobs


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    probs = sampling_probs(row, p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, min-p and
    top-p, renormalised. Speculative sampling accepts draft tokens against it."""
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
    return probs / probs.sum()
