"""Named registries filled by the register_* hooks, and capabilities as data.

The core picks every plugin by name. An unknown name is an error that lists the valid ones.
Whether a configuration can run with what is registered is `plugserve.validation`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from plugserve.attention.capabilities import BackendCapabilities
from plugserve.attention.whitelist import (
    PAGE_TREE_WHITELIST,
    page_tree_whitelist_text,
    whitelisted_for_page_tree,
)
from plugserve.grammar.base import GrammarCapabilities

__all__ = ["PAGE_TREE_WHITELIST", "page_tree_allowed", "page_tree_whitelist_text"]

if TYPE_CHECKING:
    pass

# Built-ins that cannot be disabled with `--plugin no:NAME`: the engine cannot run without them.
ESSENTIAL_PLUGINS: tuple[str, ...] = ("builtin",)


class RegistryError(ValueError):
    """A name is unknown, registered twice, or a configuration is unsupported."""


class EntryLoadError(RegistryError):
    """A registered loader failed: the plugin was selected but cannot run here."""


@dataclass(frozen=True)
class SpecCapabilities:
    """What a speculative algorithm declares; each one declared is a promise the speculative
    conformance suite holds it to (docs/spec_algorithms.md)."""

    topk_gt1: bool = True  # tree drafting (several branches per draft step)
    overlap: bool = True  # v2: accepted length resolved one step late
    needs_draft_model: bool = False
    # The plugin ships a draft model for the built-in default model (used when neither the
    # model nor the draft model is named).
    default_draft_for_default_model: bool = False
    # It checks draft tokens against a request's grammar (plugserve.grammar.constraint), so
    # structured outputs run with it; otherwise such requests are refused.
    grammar: bool = False

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class CachePolicyCapabilities:
    """What a cache policy declares; each one declared is a promise the cache-policy
    conformance suite holds it to (docs/cache_policies.md)."""

    # It stores what `insert` gives it and offers it back through `match_prefix`; False: the
    # KV manager never inserts, every release frees everything, nothing ever matches.
    prefix_sharing: bool = True
    # It may run a model with sliding-window layers: its SWA side (`swa_*_size`, `evict_swa`)
    # is exact and its matches stop where the last window's SWA KV is gone.
    sliding_window: bool = False
    # Streaming sessions may keep their first turn's lock through it between turns:
    # `path_size` is exact for those locks.
    sessions: bool = False

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


T = TypeVar("T")


@dataclass
class Entry(Generic[T]):
    kind: str
    name: str
    loader: Callable[[], T]
    capabilities: Any = None
    description: str = ""
    plugin: str = ""  # plugin (entry point name) that registered it
    distribution: str = ""
    version: str = ""
    # A cheap probe run by `plugserve plugins` (never at import): None when this machine can
    # run the entry, else one line saying why not (a missing library, an ABI mismatch, ...).
    availability: Callable[[], str | None] | None = field(default=None, repr=False)
    _loaded: T | None = field(default=None, repr=False)

    def page_tree_allowed(self) -> bool:
        """Whether the whitelist lets this attention backend run page_size>1 with topk>1."""
        return whitelisted_for_page_tree(self.distribution, self.name)

    def unavailable_reason(self) -> str | None:
        """Why this machine cannot run the entry, in one line (None: nothing known against)."""
        if self.availability is None:
            return None
        try:
            return self.availability()
        except Exception as exc:  # a broken probe must not break the listing
            return f"availability check failed: {type(exc).__name__}: {exc}"

    def load(self) -> T:
        """Import and return the registered object (heavy imports happen only here)."""
        if self._loaded is None:
            try:
                self._loaded = self.loader()
            except Exception as exc:
                raise EntryLoadError(
                    f"{self.kind} {self.name!r} (plugin {self.plugin!r}, "
                    f"{self.distribution or 'built-in'}) could not be loaded: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return self._loaded

    def capabilities_dict(self) -> dict[str, Any]:
        """The capabilities as shown by `plugserve plugins`; an attention backend's include
        `"page>1+topk>1"`, which the whitelist decides, right after `"topk>1"`."""
        caps = self.capabilities
        if caps is None:
            return {}
        shown = dict(caps.as_dict()) if hasattr(caps, "as_dict") else dict(caps.__dict__)
        if not isinstance(caps, BackendCapabilities):
            return shown
        whitelisted = self.page_tree_allowed()
        out: dict[str, Any] = {}
        for key, value in shown.items():
            out[key] = value
            if key == "topk>1":
                out["page>1+topk>1"] = whitelisted
        out.setdefault("page>1+topk>1", whitelisted)
        return out

    def origin(self) -> str:
        """`plugin 'x' (dist 1.0)`: who registered this entry, for error messages."""
        dist = f"{self.distribution} {self.version}".strip() or "built-in"
        return f"plugin {self.plugin!r} ({dist})"


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def add(self, entry: Entry[T]) -> None:
        if entry.name in self._entries:
            raise RegistryError(duplicate_message(self._entries[entry.name], entry))
        self._entries[entry.name] = entry

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self.names()) or 'none'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._entries[name] for name in self.names())

    def __len__(self) -> int:
        return len(self._entries)


def page_tree_allowed(entry: Entry[Any]) -> bool:
    """Whether the whitelist lets attention backend `entry` run page_size>1 with topk>1."""
    return entry.page_tree_allowed()


def duplicate_message(first: Entry[Any], second: Entry[Any]) -> str:
    return (
        f"{first.kind} {first.name!r} is registered twice: by {first.origin()} and by "
        f"{second.origin()}; uninstall one, or disable it with --plugin no:{second.plugin}"
    )


class RegisterAttentionBackend(Protocol):
    def __call__(
        self,
        name: str,
        loader: Callable[[], Any],
        capabilities: BackendCapabilities,
        description: str = "",
        availability: Callable[[], str | None] | None = None,
    ) -> None: ...


class RegisterSpecAlgorithm(Protocol):
    def __call__(
        self,
        name: str,
        loader: Callable[[], Any],
        capabilities: SpecCapabilities | None = None,
        description: str = "",
    ) -> None: ...


class RegisterCachePolicy(Protocol):
    def __call__(
        self,
        name: str,
        loader: Callable[[], Any],
        capabilities: CachePolicyCapabilities | None = None,
        description: str = "",
    ) -> None: ...


class RegisterGrammarBackend(Protocol):
    def __call__(
        self,
        name: str,
        loader: Callable[[], Any],
        capabilities: GrammarCapabilities | None = None,
        description: str = "",
    ) -> None: ...


class RegisterToolParser(Protocol):
    def __call__(self, name: str, loader: Callable[[], Any], description: str = "") -> None: ...


class RegisterInvariantChecker(Protocol):
    def __call__(self, name: str, loader: Callable[[], Any], description: str = "") -> None: ...


class RegisterFixToggle(Protocol):
    def __call__(self, name: str, description: str) -> None: ...


@dataclass
class Registries:
    attention: Registry[Any] = field(default_factory=lambda: Registry("attention backend"))
    spec: Registry[Any] = field(default_factory=lambda: Registry("speculative algorithm"))
    cache: Registry[Any] = field(default_factory=lambda: Registry("cache policy"))
    checkers: Registry[Any] = field(default_factory=lambda: Registry("invariant checker"))
    grammar: Registry[Any] = field(default_factory=lambda: Registry("grammar backend"))
    tool_parsers: Registry[Any] = field(default_factory=lambda: Registry("tool parser"))

    def all_entries(self) -> list[Entry[Any]]:
        return [*self.attention, *self.spec, *self.cache, *self.checkers, *self.grammar,
                *self.tool_parsers]


@dataclass
class Staging:
    """What one plugin registers, held apart until all of its register hooks succeed.

    A plugin that fails half-way then leaves nothing behind in the registries.
    """

    plugin: str
    distribution: str
    version: str
    entries: list[tuple[Registry[Any], Entry[Any]]] = field(default_factory=list)
    fix_toggles: list[tuple[str, str]] = field(default_factory=list)

    def registrar(self, registry: Registry[Any], caps_type: type | None) -> Callable[..., None]:
        """The `register` callable a register hook gets; `caps_type` None = no capabilities."""
        if caps_type is None:

            def register_without_capabilities(
                name: str, loader: Callable[[], Any], description: str = ""
            ) -> None:
                self._add(registry, None, name, loader, None, description)

            return register_without_capabilities

        def register(
            name: str, loader: Callable[[], Any], capabilities: Any = None, description: str = "",
            availability: Callable[[], str | None] | None = None,
        ) -> None:
            self._add(registry, caps_type, name, loader, capabilities, description, availability)

        return register

    def fix_toggle_registrar(self) -> RegisterFixToggle:
        def register(name: str, description: str) -> None:
            if not isinstance(name, str) or not name:
                raise RegistryError(f"fix toggle name must be a non-empty string, got {name!r}")
            self.fix_toggles.append((name, description))

        return register

    def _add(
        self,
        registry: Registry[Any],
        caps_type: type | None,
        name: str,
        loader: Callable[[], Any],
        capabilities: Any,
        description: str,
        availability: Callable[[], str | None] | None = None,
    ) -> None:
        kind = registry.kind
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{kind} name must be a non-empty string, got {name!r}")
        if not callable(loader):
            raise RegistryError(
                f"{kind} {name!r}: loader must be a zero-argument callable, got {loader!r}"
            )
        # Attention backends must state their capabilities; the others have safe defaults.
        defaults = (SpecCapabilities, CachePolicyCapabilities, GrammarCapabilities)
        if capabilities is None and caps_type is not None and caps_type in defaults:
            capabilities = caps_type()
        if caps_type is not None and not isinstance(capabilities, caps_type):
            raise RegistryError(
                f"{kind} {name!r}: capabilities must be a {caps_type.__name__}, "
                f"got {type(capabilities).__name__}"
            )
        entry: Entry[Any] = Entry(
            kind=kind,
            name=name,
            loader=loader,
            capabilities=capabilities,
            description=description,
            plugin=self.plugin,
            distribution=self.distribution,
            version=self.version,
            availability=availability,
        )
        self.entries.append((registry, entry))
