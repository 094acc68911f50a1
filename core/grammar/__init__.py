"""Structured outputs: the grammar-backend plugin contract (`base`), the compile cache that
runs off the scheduler's thread (`service`) and each request's matcher state (`state`).

docs/grammar_backends.md describes the contract and its conformance suite.
"""

from __future__ import annotations

from plugserve.grammar.base import (
    GrammarBackend,
    GrammarCapabilities,
    GrammarContext,
    GrammarError,
    GrammarMatcher,
)

__all__ = [
    "GrammarBackend",
    "GrammarCapabilities",
    "GrammarContext",
    "GrammarError",
    "GrammarMatcher",
]
