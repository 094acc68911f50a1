"""What the engine hands back: a request's result, and the events of a stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamEvent:
    index: int
    token_ids: list[int]  # new tokens since the last event for this request
    text: str  # decoded text of the new tokens
    finished: bool
    result: GenerateResult | None = None  # set on the final event


def generate_result(
    index: int, req: Req, decode: Callable[[list[int]], str]
) -> GenerateResult:
    """The result of one request, as `generate` returns it and a stream's final event
    carries."""
    ids = list(req.output_ids)
    text = decode(ids) if ids else ""
    stop_str = req.stop_str
    if stop_str and stop_str in text:
        text = text[: text.index(stop_str)]
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
    return GenerateResult(
        index=index, text=text, token_ids=ids, prompt_tokens=len(req.origin_input_ids),
        output_tokens=len(ids), finish_reason=req.finished_reason, error=req.error,
        logprobs=list(req.output_logprobs) if req.sampling.logprobs else None, stats=stats,
    )
