"""The speculative algorithm under test: its registry entry, class and declared capabilities,
and what the suite answers from them.

Resolved by name through the plugin host, exactly as the engine resolves `EngineConfig.spec`,
so the suite tests what `--spec NAME` would run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugserve.registry import Entry, RegistryError, SpecCapabilities
from plugserve.spec.base import SpecAlgorithm
from plugserve.testing.conformance.declared import DeclaredRequirements


@dataclass(frozen=True)
class SpecAlgorithmUnderTest:
    name: str
    entry: Entry[Any]

    @classmethod
    def resolve(cls, name: str) -> SpecAlgorithmUnderTest:
        """The registered algorithm `name` (a `RegistryError` listing the names if unknown;
        `none` is plain decoding, with nothing to test)."""
        from plugserve.plugins import get_plugin_host

        registry = get_plugin_host().registries.spec
        entry = registry.get(name)
        if name == "none":
            others = [n for n in registry.names() if n != "none"]
            raise RegistryError(
                "speculative algorithm 'none' is plain decoding: the speculative suite has "
                f"nothing to test; name one of: {', '.join(others) or 'none installed'}")
        return cls(name, entry)

    @property
    def capabilities(self) -> SpecCapabilities:
        caps = self.entry.capabilities
        return caps if isinstance(caps, SpecCapabilities) else SpecCapabilities()

    @property
    def algorithm_class(self) -> type[SpecAlgorithm]:
        """The registered class (loaded on first use, as the engine loads it)."""
        cls = self.entry.load()
        if not (isinstance(cls, type) and issubclass(cls, SpecAlgorithm)):
            raise TypeError(f"speculative algorithm {self.name!r}: its loader returned {cls!r}, "
                            "not a plugserve.spec.base.SpecAlgorithm subclass")
        return cls


class SpecRequirements(DeclaredRequirements):
    """Requirement names of the speculative suite, answered from `SpecCapabilities`:
    `topk_gt1` (tree drafting), `overlap` (the overlap loop)."""

    kind = "speculative algorithm"
    not_requirements = DeclaredRequirements.not_requirements | {"caps"}
    target: SpecAlgorithmUnderTest

    @property
    def caps(self) -> SpecCapabilities:
        return self.target.capabilities

    def topk_gt1(self) -> str | None:
        if self.caps.topk_gt1:
            return None
        return f"speculative algorithm {self.name!r} declares topk_gt1=False (no tree drafting)"

    def overlap(self) -> str | None:
        if self.caps.overlap:
            return None
        return f"speculative algorithm {self.name!r} declares overlap=False (normal loop only)"
