"""The grammar backend under test: its registry entry, capabilities, and instances built the
way the engine builds them (`cls(GrammarContext)`) on the tiny test model's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plugserve.grammar.base import GrammarBackend, GrammarCapabilities, GrammarContext
from plugserve.registry import Entry


@dataclass(frozen=True)
class GrammarBackendUnderTest:
    name: str
    entry: Entry[Any]

    @classmethod
    def resolve(cls, name: str) -> GrammarBackendUnderTest:
        from plugserve.plugins import get_plugin_host

        return cls(name, get_plugin_host().registries.grammar.get(name))

    @property
    def capabilities(self) -> GrammarCapabilities:
        caps = self.entry.capabilities
        return caps if isinstance(caps, GrammarCapabilities) else GrammarCapabilities()

    def build(self, model_dir: Path) -> GrammarBackend:
        from plugserve.model.tokenizer import Tokenizer

        cls = self.entry.load()
        if not (isinstance(cls, type) and issubclass(cls, GrammarBackend)):
            raise TypeError(f"grammar backend {self.name!r}: its loader returned {cls!r}, not a "
                            "plugserve.grammar.GrammarBackend subclass")
        tokenizer = Tokenizer.from_hf_folder(model_dir)
        vocab = int(tokenizer.vocab_size)
        return cls(GrammarContext(vocab, tokenizer, tokenizer.eos_token_ids))

    def require_kind(self, kind: str) -> None:
        if kind not in self.capabilities.kinds:
            pytest.skip(f"grammar backend {self.name!r} does not declare {kind}")

    def require_rollback(self) -> None:
        if not self.capabilities.rollback:
            pytest.skip(f"grammar backend {self.name!r} does not declare rollback")
