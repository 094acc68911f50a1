"""The grammar-backend contract: what a plugin of the `grammar backend` kind implements.

A backend is built once per engine from a `GrammarContext` (the model's logits width, its
tokenizer and EOS ids), on the compile thread, the first time a request asks for structured
output. `compile` turns a `GrammarSpec` into the backend's compiled grammar (the core caches
it by the spec's text and calls it off the scheduler's thread); `new_matcher` makes one
request's matcher; `apply_masks` masks the logits of every constrained row of a forward at once
(the batched matcher), on the forward thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from plugserve.structured import GRAMMAR_KINDS, GrammarSpec


class GrammarError(ValueError):
    """The grammar a request gave cannot be compiled: the message says what is wrong."""


@dataclass(frozen=True)
class GrammarCapabilities:
    """What a grammar backend declares; the grammar conformance suite holds it to each."""

    # The request kinds it compiles (a subset of plugserve.structured.GRAMMAR_KINDS).
    kinds: frozenset[str] = field(default_factory=lambda: frozenset(GRAMMAR_KINDS))
    # Its matchers can undo accepted tokens (`rollback`), as speculative decoding needs.
    rollback: bool = False
    # How many tokens a matcher can roll back at most (with rollback); 0 = no limit.
    max_rollback_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["kinds"] = sorted(self.kinds)
        return out


@dataclass(frozen=True)
class GrammarContext:
    vocab_size: int  # the model's logits width (may exceed the tokenizer's vocabulary)
    tokenizer: Any  # plugserve.model.tokenizer.Tokenizer (its `backend` is a `tokenizers` one)
    eos_token_ids: frozenset[int]  # a finished grammar allows exactly these


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token: int) -> bool:
        """Advance over `token`; False (state unchanged) when the grammar forbids it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and an EOS token was accepted."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (backends declaring `rollback`)."""


class GrammarBackend(ABC):
    def __init__(self, context: GrammarContext) -> None:
        self.context = context

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec`; `GrammarError` naming the problem when the schema,
        regex or grammar is invalid. Runs on the compile thread, never on the forward one."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def apply_masks(self, logits: torch.Tensor, rows: list[int],
                    matchers: list[GrammarMatcher]) -> None:
        """Set to -inf, in place, every logit of `logits[rows[i]]` that `matchers[i]` forbids
        next, for all rows at once. A terminated matcher's row is left as it is."""
