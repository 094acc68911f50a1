"""A toy third-party grammar backend, in plain Python: `choice` only (the output is one of a
list of strings), matched character by character over the vocabulary's decoded tokens.

Registered as a plugin ("toy_grammars") by the `grammar_plugins` fixture, twice: `toy_choice`,
correct, which the grammar conformance suite passes; and `toy_choice_early_eos`, with a planted
bug (EOS is allowed before the choice is complete), which the suite must catch.
"""

from __future__ import annotations

from typing import Any

import torch

from plugserve.grammar import (
    GrammarBackend,
    GrammarCapabilities,
    GrammarContext,
    GrammarError,
    GrammarMatcher,
)
from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterGrammarBackend
from plugserve.structured import GrammarSpec

CAPABILITIES = GrammarCapabilities(kinds=frozenset({"choice"}))


class ToyMatcher:
    def __init__(self, backend: ToyChoiceBackend, choices: tuple[str, ...]) -> None:
        self.backend = backend
        self.choices = choices
        self.prefix = ""
        self.terminated = False

    def allows(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.backend.context.eos_token_ids:
            return self.eos_allowed()
        text = self.backend.texts.get(token)
        return bool(text) and any(c.startswith(self.prefix + text) for c in self.choices)

    def eos_allowed(self) -> bool:
        return self.prefix in self.choices

    def accept_token(self, token: int) -> bool:
        if not self.allows(token):
            return False
        if token in self.backend.context.eos_token_ids:
            self.terminated = True
        else:
            self.prefix += self.backend.texts[token]
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError("toy_choice does not declare rollback")


class ToyChoiceBackend(GrammarBackend):
    matcher_class: type[ToyMatcher] = ToyMatcher

    def __init__(self, context: GrammarContext) -> None:
        super().__init__(context)
        tok = context.tokenizer.backend
        self.texts = {t: tok.decode([t]) for t in range(min(context.vocab_size,
                                                            tok.get_vocab_size()))}

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.kind != "choice":
            raise GrammarError(f"toy_choice compiles choice only, not {spec.kind}")
        return spec.choices

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return self.matcher_class(self, compiled)

    def apply_masks(self, logits: torch.Tensor, rows: list[int],
                    matchers: list[GrammarMatcher]) -> None:
        for row, matcher in zip(rows, matchers, strict=True):
            assert isinstance(matcher, ToyMatcher)
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[[t for t in range(logits.shape[1]) if matcher.allows(t)]] = True
            logits[row, ~keep.to(logits.device)] = float("-inf")


class EarlyEosMatcher(ToyMatcher):
    def eos_allowed(self) -> bool:  # the planted bug: the end may come at any point
        return True


class EarlyEosBackend(ToyChoiceBackend):
    matcher_class = EarlyEosMatcher


@hookimpl
def plugserve_register_grammar_backends(register: RegisterGrammarBackend) -> None:
    register("toy_choice", lambda: ToyChoiceBackend, CAPABILITIES,
             description="toy: choice only, in Python")
    register("toy_choice_early_eos", lambda: EarlyEosBackend, CAPABILITIES,
             description="toy with a planted bug: EOS before the choice is complete")
