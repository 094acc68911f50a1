"""What the engine hands back: a request's result, and the events of a stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plugserve.structs.req import Req


@dataclass
class GenerateResult:
    index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    error: str | None = None
    logprobs: list[float] | None = None
    # With sampling.top_logprobs: per output token, the N most likely (token id, logprob).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With sampling.prompt_logprobs: per prompt token, its logprob given the tokens before it
    # (None for the first, and for positions a streaming session held) and the top N.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    # n > 1 / best_of: which sample this is (0..n-1; with best_of > n, the rank by cumulative
    # logprob), the sum of its tokens' logprobs (when they were computed), and on the result
    # `generate` returns per prompt: every returned sample (the fields above are sample 0's).
    sample_index: int = 0
    cumulative_logprob: float | None = None
    samples: list[GenerateResult] = field(default_factory=list)


@dataclass
class StreamEvent:
    index: int
    token_ids: list[int]  # new tokens since the last event for this request
    # The text the new tokens add to the output's (decoded with the tokens before them, so
    # the events' texts add up to the whole output's decoded text, before any stop-string
    # cut; a character split across tokens comes whole in the event of its last token).
    text: str
    finished: bool
    result: GenerateResult | None = None  # set on the final event
    sample_index: int = 0  # n > 1: which sample of the prompt (each has its own final event)


def output_text(req: Req, decode: Callable[..., str]) -> str:
    """The request's decoded output, cut at the stop string that ended it (kept, and the text
    cut after it, with sampling.include_stop_str_in_output)."""
    ids = list(req.output_ids)
    if not ids:
        return ""
    sp = req.sampling
    text = decode(ids) if sp.skip_special_tokens else decode(ids, skip_special_tokens=False)
    return cut_at_stop(text, req.stop_str, sp.include_stop_str_in_output)


def cut_at_stop(text: str, stop_str: str | None, include: bool) -> str:
    if stop_str and stop_str in text:
        end = text.index(stop_str)
        return text[: end + len(stop_str)] if include else text[:end]
    return text


def top_logprobs_of(req: Req) -> list[list[tuple[int, float]]] | None:
    """Per output token its top logprobs (as the runner recorded them by position)."""
    if req.sampling.top_logprobs <= 0:
        return None
    base = len(req.origin_input_ids)
    return [req.top_logprobs_at.get(base + k, []) for k in range(len(req.output_ids))]


def prompt_logprobs_of(req: Req) -> tuple[list[float | None] | None,
                                           list[list[tuple[int, float]] | None] | None]:
    if req.sampling.prompt_logprobs is None:
        parent = req.fork_parent
        if parent is not None and parent.sampling.prompt_logprobs is not None:
            return prompt_logprobs_of(parent)  # a forked sample: its parent computed them
        return None, None
    n = len(req.origin_input_ids)
    values: Sequence[float | None] = req.prompt_logprobs or [None] * n
    tops: Sequence[list[tuple[int, float]] | None] = req.prompt_top_logprobs or [None] * n
    return list(values), list(tops)


def generate_result(
    index: int, req: Req, decode: Callable[..., str]
) -> GenerateResult:
    """The result of one request, as `generate` returns it and a stream's final event
    carries."""
    ids = list(req.output_ids)
    text = output_text(req, decode)
    stats: dict[str, Any] = {"cached_tokens": req.cached_tokens,
                             "retractions": req.retract_count}
    if req.first_token_s is not None:
        stats["ttft_s"] = req.first_token_s - req.created_s
    if req.finished_s is not None:
        latency = req.finished_s - req.created_s
        stats["latency_s"] = latency
        stats["output_tokens_per_s"] = len(ids) / latency if latency > 0 else 0.0
    if req.spec_verify_steps:
        stats["spec_verify_steps"] = req.spec_verify_steps
        stats["spec_accepted_tokens"] = req.spec_accepted_tokens
        stats["spec_accept_len_mean"] = (
            (req.spec_accepted_tokens + req.spec_verify_steps) / req.spec_verify_steps
        )
        stats["spec_accept_hist"] = dict(req.spec_accept_hist)
    prompt_values, prompt_tops = prompt_logprobs_of(req)
    return GenerateResult(
        index=index, text=text, token_ids=ids, prompt_tokens=len(req.origin_input_ids),
        output_tokens=len(ids), finish_reason=req.finished_reason, error=req.error,
        logprobs=list(req.output_logprobs) if req.sampling.logprobs else None,
        top_logprobs=top_logprobs_of(req), prompt_logprobs=prompt_values,
        prompt_top_logprobs=prompt_tops, stats=stats, sample_index=req.sample_index,
        cumulative_logprob=sum(req.output_logprobs) if req.sampling.logprobs else None,
    )


def group_result(index: int, parent: Req, decode: Callable[..., str],
                 want_logprobs: bool) -> GenerateResult:
    """The result for one prompt: sample 0's fields, and `samples` the n returned. With
    best_of > n, the n samples of the highest cumulative logprob, best first (ties: lower
    sample index first); their logprobs stay only when they were asked for."""
    results = [generate_result(index, req, decode) for req in parent.group]
    sp = parent.sampling
    if sp.best_of is not None and sp.best_of > sp.n:
        ranked = sorted(results, key=lambda r: -(r.cumulative_logprob or 0.0))
        results = [replace(r, sample_index=k) for k, r in enumerate(ranked[: sp.n])]
    if not want_logprobs:
        for res in results:
            res.logprobs = None
    return replace(results[0], samples=results)
