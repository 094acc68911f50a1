"""A request body -> what the engine takes: token-id prompts and one SamplingParams.

Prompts are tokenized here, on the HTTP side, with the engine's tokenizer (read-only and
thread-safe: the engine thread never changes it), exactly as `Engine.submit` would: text with
`tokenizer.encode`, chat messages with `tokenizer.apply_chat_template`. The engine then gets
token ids, so the server knows each prompt's length (413 when it is over the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugserve.sampling import SamplingParams
from plugserve.server.errors import APIError, engine_rejection
from plugserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields


@dataclass(frozen=True)
class Generation:
    """One HTTP request's work: its prompts (one engine request each) and their sampling."""

    prompts: list[list[int]]
    sampling: SamplingParams
    session_id: str | None = None  # one turn of this streaming session
    session_offset: int | None = None


def _sampling(body: GenerationFields, max_new_tokens: int, logprobs: bool) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_strings,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def completion_generation(body: CompletionRequest, tokenizer: Any) -> Generation:
    prompts = [
        list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in body.prompts
    ]
    max_new = body.max_tokens if body.max_tokens is not None else 16
    return _with_session(body, Generation(prompts, _sampling(body, max_new,
                                                             body.logprobs is not None)))


def chat_generation(body: ChatCompletionRequest, tokenizer: Any, context_len: int) -> Generation:
    from plugserve.model.chat_template import ChatTemplateError

    messages = [m.template_dict() for m in body.messages]
    try:
        ids = list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt
        ))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    limit = body.token_limit
    # Without a limit, generate up to the context (the engine refuses a prompt that leaves
    # no room, with its own message).
    max_new = limit if limit is not None else max(1, context_len - len(ids))
    return _with_session(body, Generation([ids], _sampling(body, max_new, body.logprobs)))


def _with_session(body: GenerationFields, gen: Generation) -> Generation:
    if body.session_id is None:
        if body.session_offset is not None:
            raise APIError(400, "session_offset needs a session_id", param="session_offset")
        return gen
    if len(gen.prompts) != 1:
        raise APIError(400, f"a session turn takes one prompt, got {len(gen.prompts)}",
                       param="prompt")
    return Generation(gen.prompts, gen.sampling, body.session_id, body.session_offset)


def precheck(gen: Generation, vocab_size: int, context_len: int) -> None:
    """The engine's checks that need no engine state, before the request queues, so a bad
    request gets its 400 / 413 even when the queue is full (a 503 would invite a retry). The
    engine checks everything again when it takes the request."""
    problems = gen.sampling.problems(vocab_size)
    longest = max(len(ids) for ids in gen.prompts)
    for ids in gen.prompts:
        if not ids:
            problems.append("prompt is empty")
        elif len(ids) >= context_len:
            problems.append(f"prompt has {len(ids)} tokens; the context holds {context_len}, "
                            "and at least one must be left to generate")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            problems.append(f"prompt has token ids outside the vocabulary "
                            f"(0..{vocab_size - 1}): {bad[:5]}")
    if problems:
        raise engine_rejection("; ".join(dict.fromkeys(problems)), longest, context_len)
