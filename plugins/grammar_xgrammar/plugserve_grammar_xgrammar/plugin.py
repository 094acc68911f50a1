"""Registers the `xgrammar` grammar backend; xgrammar is imported only when it is selected."""

from __future__ import annotations

from typing import Any

from plugserve.grammar import GrammarCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterGrammarBackend
from plugserve.structured import GRAMMAR_KINDS

# xgrammar 0.2.8 matchers roll back any number of tokens.
CAPABILITIES = GrammarCapabilities(kinds=frozenset(GRAMMAR_KINDS), rollback=True)


def _load() -> Any:
    from plugserve_grammar_xgrammar.backend import XGrammarBackend

    return XGrammarBackend


@hookimpl
def plugserve_register_grammar_backends(register: RegisterGrammarBackend) -> None:
    register("xgrammar", _load, CAPABILITIES,
             description="xgrammar 0.2.8: JSON schema, JSON object, regex, choice, EBNF; "
                         "token bitmask applied on CPU tensors")
