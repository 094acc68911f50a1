"""The cache policy under test: its registry entry, class and declared capabilities, and what
the suite answers from them.

Resolved by name through the plugin host, exactly as the engine resolves `EngineConfig.cache`,
so the suite tests what `--cache NAME` would run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugserve.cache.base import PrefixCache
from plugserve.pools.allocator import PagedAllocator
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.registry import CachePolicyCapabilities, Entry
from plugserve.testing.conformance.declared import DeclaredRequirements


@dataclass(frozen=True)
class CachePolicyUnderTest:
    name: str
    entry: Entry[Any]

    @classmethod
    def resolve(cls, name: str) -> CachePolicyUnderTest:
        """The registered policy `name` (a `RegistryError` listing the names if unknown)."""
        from plugserve.plugins import get_plugin_host

        return cls(name, get_plugin_host().registries.cache.get(name))

    @property
    def capabilities(self) -> CachePolicyCapabilities:
        caps = self.entry.capabilities
        return caps if isinstance(caps, CachePolicyCapabilities) else CachePolicyCapabilities()

    @property
    def policy_class(self) -> type[PrefixCache]:
        """The registered class (loaded on first use, as the engine loads it)."""
        cls = self.entry.load()
        if not (isinstance(cls, type) and issubclass(cls, PrefixCache)):
            raise TypeError(f"cache policy {self.name!r}: its loader returned {cls!r}, not a "
                            "plugserve.cache.base.PrefixCache subclass")
        return cls

    def build(self, rows: ReqToTokenPool, allocator: PagedAllocator,
              page_size: int) -> PrefixCache:
        """An instance, built the way the engine builds it."""
        return self.policy_class(rows, allocator, page_size)


class CacheRequirements(DeclaredRequirements):
    """Requirement names of the cache suite, answered from `CachePolicyCapabilities`:
    `prefix_sharing`, `sliding_window`, `sessions`."""

    kind = "cache policy"
    not_requirements = DeclaredRequirements.not_requirements | {"caps"}
    target: CachePolicyUnderTest

    @property
    def caps(self) -> CachePolicyCapabilities:
        return self.target.capabilities

    def prefix_sharing(self) -> str | None:
        if self.caps.prefix_sharing:
            return None
        return (f"cache policy {self.name!r} declares prefix_sharing=False (the KV manager "
                "never inserts into it)")

    def sliding_window(self) -> str | None:
        if self.caps.sliding_window:
            return None
        return (f"cache policy {self.name!r} declares sliding_window=False (the engine refuses "
                "it for models with sliding-window layers)")

    def sessions(self) -> str | None:
        if self.caps.sessions:
            return None
        return (f"cache policy {self.name!r} declares sessions=False (the engine refuses "
                "streaming sessions with it)")
