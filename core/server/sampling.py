"""A request body -> what the engine takes: token-id prompts and one SamplingParams.

Prompts are tokenized here, on the HTTP side, with the engine's tokenizer (read-only and
thread-safe: the engine thread never changes it), exactly as `Engine.submit` would: text with
`tokenizer.encode`, chat messages with `tokenizer.apply_chat_template`. The engine then gets
token ids, so the server knows each prompt's length (413 when it is over the context, 400
when `max_tokens` cannot fit beside it).

Logprobs: completions' `logprobs: N` is each generated token's logprob plus the N most likely
(`top_logprobs` in the engine); `echo` returns the prompt with its tokens' logprobs (the
engine's `prompt_logprobs`, N alternatives too); `max_tokens: 0` with echo generates nothing
(the engine samples one token, which is dropped). Chat: `logprobs` + `top_logprobs: N`. N is
at most `--max-logprobs` (20, vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from plugserve.sampling import SamplingParams
from plugserve.server.errors import APIError, engine_rejection
from plugserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from plugserve.server.structured import body_grammar, chat_grammar
from plugserve.structured import GrammarSpec

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass(frozen=True)
class Generation:
    """One HTTP request's work: its prompts (one engine request each) and their sampling."""

    prompts: list[list[int]]
    sampling: SamplingParams
    session_id: str | None = None  # one turn of this streaming session
    session_offset: int | None = None
    max_tokens_given: bool = True  # False: a default the server may lower to fit the context
    echo: bool = False  # the prompt (and its logprobs) goes back before the output
    drop_output: bool = False  # max_tokens 0: the one sampled token is not returned
    grammar_param: str | None = None  # the field the output's grammar came from
    stream_interval: int | None = None  # the request's tokens per streamed chunk, if given


def _checked_count(value: int | None, name: str, limit: int) -> int | None:
    if value is not None and not 0 <= value <= limit:
        raise APIError(400, f"{name} must be in [0, {limit}] (--max-logprobs), got {value}",
                       param=name)
    return value


def _logit_bias(body: GenerationFields) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids (integers as strings), "
                                f"got {key!r}", param="logit_bias") from None
        out[token] = value
    return out


def _sampling(body: GenerationFields, max_new_tokens: int, *, logprobs: bool, top: int,
              prompt_logprobs: int | None, grammar: GrammarSpec | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_strings,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top,
        prompt_logprobs=prompt_logprobs,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=_logit_bias(body),
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=grammar,
        n=body.n,
        best_of=getattr(body, "best_of", None),
    )


def check_samples(gen: Generation, max_n: int, stream: bool) -> None:
    """n and best_of within the server's --max-n; best_of > n is chosen after all samples
    finish, so it cannot be streamed (vLLM refuses it too)."""
    sp = gen.sampling
    for name, value in (("n", sp.n), ("best_of", sp.best_of)):
        if value is not None and value > max_n:
            raise APIError(400, f"{name} is {value}; this server allows at most {max_n} "
                                "samples per prompt (--max-n)", param=name)
    if stream and sp.best_of is not None and sp.best_of > sp.n:
        raise APIError(400, f"best_of ({sp.best_of}) > n ({sp.n}) cannot be streamed: the "
                            "best samples are known only when all finished; send stream=false "
                            "or best_of=n", param="best_of")
    if gen.session_id is not None and sp.num_samples > 1:
        raise APIError(400, f"a session turn takes one sample, got n={sp.n}, best_of="
                            f"{sp.best_of}: its KV becomes the session's", param="n")


def completion_generation(body: CompletionRequest, tokenizer: Any, max_logprobs: int
                          ) -> Generation:
    prompts = [
        list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in body.prompts
    ]
    top = _checked_count(body.logprobs, "logprobs", max_logprobs)
    prompt_top = _checked_count(body.prompt_logprobs, "prompt_logprobs", max_logprobs)
    if body.echo and top is not None and prompt_top is None:
        prompt_top = top  # echo returns the prompt's logprobs like the output's
    given = body.max_tokens is not None
    max_new = body.max_tokens if given else DEFAULT_COMPLETION_TOKENS
    drop = max_new == 0
    grammar, param = body_grammar(body)
    sampling = _sampling(body, max(1, max_new or 0), logprobs=top is not None, top=top or 0,
                         prompt_logprobs=prompt_top, grammar=grammar)
    gen = Generation(prompts, sampling, max_tokens_given=given, echo=body.echo,
                     drop_output=drop, grammar_param=param,
                     stream_interval=body.stream_interval)
    return _with_session(body, gen)


def chat_generation(body: ChatCompletionRequest, tokenizer: Any, context_len: int,
                    max_logprobs: int) -> Generation:
    from plugserve.model.chat_template import ChatTemplateError

    messages = [m.template_dict() for m in body.messages]
    tools = None if body.tool_mode == "none" else [
        t.model_dump(exclude_none=True) for t in body.tools or ()]
    grammar, param = chat_grammar(body)
    try:
        ids = list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tools=tools
        ))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    top = _checked_count(body.top_logprobs, "top_logprobs", max_logprobs) or 0
    prompt_top = _checked_count(body.prompt_logprobs, "prompt_logprobs", max_logprobs)
    limit = body.token_limit
    # Without a limit, generate up to the context (the engine refuses a prompt that leaves
    # no room, with its own message).
    max_new = limit if limit is not None else max(1, context_len - len(ids))
    sampling = _sampling(body, max_new, logprobs=body.logprobs, top=top,
                         prompt_logprobs=prompt_top, grammar=grammar)
    return _with_session(body, Generation([ids], sampling, max_tokens_given=limit is not None,
                                          grammar_param=param,
                                          stream_interval=body.stream_interval))


def _with_session(body: GenerationFields, gen: Generation) -> Generation:
    if body.session_id is None:
        if body.session_offset is not None:
            raise APIError(400, "session_offset needs a session_id", param="session_offset")
        return gen
    if len(gen.prompts) != 1:
        raise APIError(400, f"a session turn takes one prompt, got {len(gen.prompts)}",
                       param="prompt")
    if gen.sampling.prompt_logprobs is not None:
        raise APIError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) are not "
                            "available in a session turn: the session holds the earlier "
                            "positions' KV, not their logits", param="session_id")
    return replace(gen, session_id=body.session_id, session_offset=body.session_offset)


def fit_to_context(gen: Generation, context_len: int) -> Generation:
    """`max_tokens` the client gave must fit beside the longest prompt (400 naming both); a
    default is lowered to what the context leaves."""
    longest = max(len(ids) for ids in gen.prompts)
    room = context_len - longest
    want = gen.sampling.max_new_tokens
    if longest + want <= context_len or room < 1 or gen.drop_output:
        return gen
    if gen.max_tokens_given:
        raise APIError(400, f"max_tokens is {want} but the prompt has {longest} tokens and the "
                            f"context holds {context_len}: at most {room} can be generated",
                       param="max_tokens")
    return replace(gen, sampling=replace(gen.sampling, max_new_tokens=room))


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
