"""What a request must satisfy before it is queued: its prompt as token ids, and every
reason its prompt and sampling parameters cannot be served by this engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugserve.pools.allocator import ceil_align
from plugserve.request_input import token_ids
from plugserve.sampling import SamplingParams, is_int
from plugserve.structured import GrammarSpec


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    context_len: int  # tokens a request's prompt and output may fill together
    pool_slots: int  # KV slots of the pool a request's tokens take
    page_size: int  # tokens per KV page: a request holds whole pages
    spec_name: str | None  # the speculative algorithm; None without speculation
    spec_reserve_len: int  # slots a speculative round writes past the last token (0: none)
    spec_checks_grammar: bool  # the algorithm checks its drafts against a request's grammar


def prompt_ids(tokenizer: Any, prompt: str | list[int], chat: bool) -> list[int]:
    """`prompt` as token ids: text is encoded (as a user message through the chat template
    with `chat`); a list must hold ints (PromptError, a ValueError, names what is wrong)."""
    if isinstance(prompt, str):
        if chat:
            return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        return list(tokenizer.encode(prompt))
    return token_ids(prompt)


def request_problems(ids: list[int], sp: SamplingParams, limits: AdmissionLimits,
                     grammar_problem: Callable[[GrammarSpec], str | None]) -> list[str]:
    """Every reason the request (`ids` from `prompt_ids`, `sp`) cannot be served; empty when
    it can. `grammar_problem` says why a grammar cannot be compiled here."""
    vocab = limits.vocab_size
    out = sp.problems(vocab)
    if not ids:
        out.append("prompt is empty")
    elif len(ids) >= limits.context_len:
        out.append(f"prompt has {len(ids)} tokens; the context holds {limits.context_len}, "
                   "and at least one must be left to generate")
    bad = [t for t in ids if not 0 <= t < vocab]  # ids are ints (prompt_ids)
    if bad:
        out.append(f"prompt has token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
    # A max_new_tokens of the wrong type is reported by sp.problems; count 1 meanwhile.
    new_tokens = max(sp.max_new_tokens, 1) if is_int(sp.max_new_tokens) else 1
    need = min(len(ids) + new_tokens, limits.context_len) + limits.spec_reserve_len
    if isinstance(sp.structured_outputs, GrammarSpec) and not sp.structured_outputs.problems():
        problem = grammar_problem(sp.structured_outputs)
        if problem is not None:
            out.append(problem)
    spec_refused = [f for f in sp.decode_time_fields()
                    if f != "structured_outputs" or not limits.spec_checks_grammar]
    if limits.spec_name is not None and spec_refused:
        out.append(f"{', '.join(spec_refused)} cannot be used with speculative "
                   f"decoding (spec={limits.spec_name!r}) yet")
    if ids and ceil_align(need, limits.page_size) > limits.pool_slots:
        out.append(f"request needs up to {need} KV slots but the pool holds "
                   f"{limits.pool_slots}; raise kv_pool_tokens")
    return out
