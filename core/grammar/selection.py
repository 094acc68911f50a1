"""The engine's grammar backend: the one the config names, if it is installed, and why a
constrained request cannot be served (no backend, or a kind the backend does not take)."""

from __future__ import annotations

from typing import Any

from plugserve.grammar.base import GrammarCapabilities, GrammarContext
from plugserve.grammar.service import GrammarService
from plugserve.structured import GrammarSpec


def grammar_service(registry: Any, name: str, vocab_size: int,
                    tokenizer: Any) -> GrammarService | None:
    """The compile service of grammar backend `name` from `registry` (None when it is not
    installed: a constrained request is then refused with the reason). Nothing is built yet."""
    if name not in registry:
        return None
    entry = registry.get(name)
    caps = entry.capabilities
    return GrammarService(
        entry.name, entry.load,
        caps if isinstance(caps, GrammarCapabilities) else GrammarCapabilities(),
        GrammarContext(vocab_size, tokenizer, tokenizer.eos_token_ids))


def grammar_problem(service: GrammarService | None, wanted: str, registry: Any,
                    spec: GrammarSpec) -> str | None:
    """Why `spec` cannot be compiled here (None: it can): no backend named `wanted` is
    installed (the message lists `registry`'s), or it does not support `spec`'s kind."""
    if service is None:
        return (f"structured outputs need a grammar backend; {wanted!r} is not installed "
                f"(installed: {', '.join(registry.names()) or 'none'}; pip install "
                "plugserve-grammar-xgrammar)")
    return service.unsupported(spec)
