"""Stop conditions: EOS, stop token ids, stop strings, max_new_tokens, context length."""

from __future__ import annotations

from collections.abc import Callable

from plugserve.structs.req import Req


def check_stop(
    req: Req,
    eos_token_ids: frozenset[int],
    context_len: int,
    decode_text: Callable[[list[int]], str],
) -> str | None:
    """The finish reason after the request's latest token, or None to keep going."""
    sp = req.sampling
    token = req.output_ids[-1]
    grammar = req.grammar
    if grammar is not None:
        if grammar.rejected is not None:
            req.error = grammar.rejected
            return "error"
        if grammar.terminated_at is not None and len(req.output_ids) >= grammar.terminated_at:
            return "stop"  # the grammar is complete (its EOS was accepted)
    if not sp.ignore_eos and token in eos_token_ids:
        return "stop"
    if token in sp.stop_token_ids:
        return "stop"
    if sp.stop and len(req.output_ids) >= sp.min_tokens:  # none before min_tokens (vLLM)
        # Decode only a tail long enough to contain any stop string.
        longest = max(len(s) for s in sp.stop)
        tail_text = decode_text(req.output_ids[-(longest + 8) :])
        for s in sp.stop:
            if s in tail_text:
                req.stop_str = s
                return "stop"
    if len(req.output_ids) >= sp.max_new_tokens:
        return "length"
    if req.seq_len >= context_len:
        return "length"
    return None
