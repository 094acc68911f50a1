"""The plugin manager: entry point group "plugserve", built-ins, isolation, selection.

Plugins load once per process (per selection), lazily: nothing here runs at import time, so
a broken plugin can never break `plugserve --help`. Each plugin is loaded and registered in
isolation: one that fails to import, uses a hook this version lacks, or raises while
registering is reported by name and distribution and the others still load. Two plugins
registering the same name is a conflict the user must resolve: registration order never
decides which one runs.
"""

from __future__ import annotations

import difflib
import os
import re
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import pluggy

from plugserve import builtin, hookspecs
from plugserve.attention.base import BackendCapabilities
from plugserve.grammar.base import GrammarCapabilities
from plugserve.registry import (
    ESSENTIAL_PLUGINS,
    CachePolicyCapabilities,
    Registries,
    SpecCapabilities,
    Staging,
    duplicate_message,
)

ENTRY_POINT_GROUP = "plugserve"
ALLOWLIST_ENV = "PLUGSERVE_PLUGINS"
BUILTIN_NAME = "builtin"

# Read the allowlist from the environment (the default of `get_plugin_host(allowlist=...)`).
FROM_ENV = "<env>"


class PluginError(RuntimeError):
    """A plugin selection cannot be honoured (unknown name, essential plugin disabled, ...)."""


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str
    hooks: list[str] = field(default_factory=list)
    plugin: object = field(default=None, repr=False, compare=False)


@dataclass
class PluginFailure:
    name: str
    distribution: str
    stage: str  # "import", "validate" or "register"
    error: str
    detail: str = ""  # traceback, shown with --debug
    version: str = ""

    def message(self) -> str:
        dist = self.distribution or "unknown distribution"
        return f"plugin {self.name!r} ({dist}) failed at {self.stage}: {self.error}"


@dataclass
class SkippedPlugin:
    """An installed plugin that was not loaded on purpose."""

    name: str
    distribution: str
    version: str
    reason: str


@dataclass
class PluginHost:
    pm: pluggy.PluginManager
    registries: Registries
    plugins: list[PluginInfo]
    failures: list[PluginFailure]
    skipped: list[SkippedPlugin] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    # Fix toggles the loaded plugins registered (name -> description), the core's included.
    fix_toggles: dict[str, str] = field(default_factory=dict)

    def failure(self, name: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.name == name), None)

    def raise_for_conflicts(self) -> None:
        """Two plugins claimed the same name: refuse to guess which one the user meant."""
        if self.conflicts:
            raise PluginError("; ".join(self.conflicts))

    def engine_hooks(self, observers: Iterable[object] = ()) -> pluggy.PluginManager:
        """A fresh hook relay for one engine: the loaded plugins plus `observers`.

        Lifecycle hooks (`plugserve_after_step`, ...) go through it, so the checker
        instances of one engine never see another engine's steps. An observer with a hook this
        version lacks, or a wrong hook signature, is a `PluginError`.
        """
        pm = _new_manager()
        for info in self.plugins:
            pm.register(info.plugin, name=info.name)
        for observer in observers:
            try:
                pm.register(observer)
                pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise PluginError(
                    f"observer {type(observer).__name__}: {_validation_message(pm, exc)}"
                ) from exc
        return pm


def parse_plugin_options(options: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split `--plugin` values into (enabled, disabled) names. `no:NAME` disables NAME."""
    enabled: list[str] = []
    disabled: list[str] = []
    for option in options:
        option = option.strip()
        if option.startswith("no:"):
            name = option[3:].strip()
            if not name:
                raise PluginError("--plugin no: needs a plugin name, e.g. --plugin no:triton")
            _refuse_essential(name)
            disabled.append(name)
        elif option:
            enabled.append(option)
    both = sorted(set(enabled) & set(disabled))
    if both:
        raise PluginError(
            f"plugin(s) {', '.join(both)} both enabled and disabled with --plugin; pick one"
        )
    return enabled, disabled


def _refuse_essential(name: str) -> None:
    if name in ESSENTIAL_PLUGINS:
        raise PluginError(
            f"plugin {name!r} is essential and cannot be disabled (--plugin no:{name}); "
            f"essential plugins: {', '.join(ESSENTIAL_PLUGINS)}"
        )


def parse_allowlist(raw: str | None) -> frozenset[str] | None:
    """`None` (unset) = every installed plugin; `""` = built-ins only; `"a,b"` = those."""
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


_hosts: dict[tuple[frozenset[str] | None, tuple[str, ...], tuple[str, ...]], PluginHost] = {}


def get_plugin_host(
    enabled: Iterable[str] = (),
    disabled: Iterable[str] = (),
    *,
    refresh: bool = False,
    allowlist: str | None = FROM_ENV,
    strict: bool = True,
) -> PluginHost:
    """Load (once per process and selection) the built-ins and the selected plugins.

    `enabled` plugins load even outside the allowlist, and failing to load one of them is an
    error; `disabled` ones never load. `allowlist` is the `PLUGSERVE_PLUGINS` syntax (see
    `parse_allowlist`); by default it is read from the environment. With `strict` (the
    default) a name registered by two plugins raises `PluginError`; `plugserve plugins`
    passes `strict=False` to show the conflict next to everything else.
    """
    enabled_t = tuple(sorted(set(enabled)))
    disabled_t = tuple(sorted(set(disabled)))
    for name in disabled_t:
        _refuse_essential(name)
    allowed = parse_allowlist(os.environ.get(ALLOWLIST_ENV) if allowlist == FROM_ENV else allowlist)
    key = (allowed, enabled_t, disabled_t)
    if refresh or key not in _hosts:
        _hosts[key] = _load(allowed, enabled_t, disabled_t)
    host = _hosts[key]
    for name in enabled_t:
        failure = host.failure(name)
        if failure is not None:
            raise PluginError(f"{failure.message()} (it was requested with --plugin {name})")
    if strict:
        host.raise_for_conflicts()
    return host


def load_plugins(
    options: Iterable[str] = (),
    *,
    allowlist: str | None = FROM_ENV,
    strict: bool = True,
    refresh: bool = False,
) -> PluginHost:
    """`get_plugin_host` from `--plugin` style options, e.g. `("triton", "no:flashinfer")`."""
    enabled, disabled = parse_plugin_options(options)
    return get_plugin_host(enabled, disabled, allowlist=allowlist, strict=strict, refresh=refresh)


def clear_plugin_hosts() -> None:
    """Forget every loaded selection (tests that change the installed plugins use this)."""
    _hosts.clear()


def installed_entry_points() -> list[EntryPoint]:
    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "", ""
    return str(dist.metadata["Name"]), str(dist.version)


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _one_line(text: str) -> str:
    return " ".join(text.split())


_UNKNOWN_HOOK = re.compile(r"unknown hook '(\w+)'")
_EXTRA_ARGS = re.compile(r"for hook '(\w+)'.*Argument\(s\) \{(.*?)\} are declared", re.S)


def _validation_message(pm: pluggy.PluginManager, exc: pluggy.PluginValidationError) -> str:
    """pluggy's verdict on a plugin (`register` checks hook signatures, `check_pending`
    unknown hooks) in one line a plugin author can act on."""
    text = str(exc)
    unknown = _UNKNOWN_HOOK.search(text)
    if unknown:
        name = unknown.group(1)
        close = difflib.get_close_matches(name, hook_spec_names(), n=1)
        return f"unknown hook {name}" + (f" (did you mean {close[0]}?)" if close else "")
    extra = _EXTRA_ARGS.search(text)
    if extra:
        name = extra.group(1)
        args = ", ".join(sorted(a.strip().strip("'\"") for a in extra.group(2).split(",")))
        spec = getattr(pm.hook, name).spec
        passed = ", ".join(spec.argnames) if spec is not None else "nothing"
        return (f"hook {name} takes {args}, which its spec does not pass "
                f"(it passes: {passed})")
    return _one_line(text)


def hook_spec_names() -> list[str]:
    """Every hook name this version of plugserve defines."""
    return sorted(name for name in vars(hookspecs) if name.startswith("plugserve_"))


def _check_selection(
    eps: list[EntryPoint],
    allowlist: frozenset[str] | None,
    enabled: tuple[str, ...],
    disabled: tuple[str, ...],
) -> None:
    known = {ep.name for ep in eps} | {BUILTIN_NAME}
    for label, names in (
        ("--plugin", [*enabled, *disabled]),
        (ALLOWLIST_ENV, sorted(allowlist or ())),
    ):
        missing = sorted(set(names) - known)
        if missing:
            raise PluginError(
                f"{label} names unknown plugin(s) {', '.join(missing)}; installed: "
                f"{', '.join(sorted(known))}"
            )


def _load(
    allowlist: frozenset[str] | None, enabled: tuple[str, ...], disabled: tuple[str, ...]
) -> PluginHost:
    pm = _new_manager()
    host = PluginHost(pm, Registries(), [], [])
    eps = installed_entry_points()
    _check_selection(eps, allowlist, enabled, disabled)

    _add_plugin(host, BUILTIN_NAME, builtin, "plugserve", _core_version())
    for ep in eps:
        dist, version = _dist_of(ep)
        reason = _skip_reason(ep.name, allowlist, enabled, disabled)
        if reason:
            host.skipped.append(SkippedPlugin(ep.name, dist, version, reason))
            continue
        if pm.has_plugin(ep.name):
            holder = next(p for p in host.plugins if p.name == ep.name)
            host.conflicts.append(
                f"plugin name {ep.name!r} is provided by two distributions, "
                f"{holder.distribution or 'built-in'} and {dist}; uninstall one"
            )
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            host.failures.append(
                PluginFailure(
                    ep.name,
                    dist,
                    "import",
                    f"{type(exc).__name__}: {exc}",
                    traceback.format_exc(),
                    version,
                )
            )
            continue
        _add_plugin(host, ep.name, module, dist, version)

    for info in list(host.plugins):
        _register_entries(host, info)
    return host


def _skip_reason(
    name: str,
    allowlist: frozenset[str] | None,
    enabled: tuple[str, ...],
    disabled: tuple[str, ...],
) -> str:
    if name in disabled:
        return f"disabled with --plugin no:{name}"
    if name == BUILTIN_NAME:
        return "the name 'builtin' is reserved for plugserve's own plugin"
    if allowlist is not None and name not in allowlist and name not in enabled:
        return f"not in {ALLOWLIST_ENV}={','.join(sorted(allowlist))!r}"
    return ""


def _core_version() -> str:
    from plugserve import __version__

    return __version__


def _add_plugin(host: PluginHost, name: str, module: object, dist: str, version: str) -> None:
    """Register one plugin's hooks; a misspelt hook or a wrong signature unregisters it."""
    pm = host.pm
    try:
        pm.register(module, name=name)  # pluggy checks each hook's arguments against its spec
        pm.check_pending()  # ... and that every hook has a spec
    except pluggy.PluginValidationError as exc:
        if pm.is_registered(module):
            pm.unregister(module)
        reason = _validation_message(pm, exc)
        host.failures.append(PluginFailure(name, dist, "validate", reason, version=version))
        return
    modname = getattr(module, "__name__", type(module).__name__)
    hooks = sorted(caller.name for caller in (pm.get_hookcallers(module) or []))
    host.plugins.append(PluginInfo(name, dist, version, modname, hooks, module))


# register hook -> (attribute of `Registries`, capabilities type; None = takes none)
_REGISTER_HOOKS: dict[str, tuple[str, type | None]] = {
    "plugserve_register_attention_backends": ("attention", BackendCapabilities),
    "plugserve_register_spec_algorithms": ("spec", SpecCapabilities),
    "plugserve_register_cache_policies": ("cache", CachePolicyCapabilities),
    "plugserve_register_invariant_checkers": ("checkers", None),
    "plugserve_register_grammar_backends": ("grammar", GrammarCapabilities),
    "plugserve_register_tool_parsers": ("tool_parsers", None),
}
_FIX_TOGGLE_HOOK = "plugserve_register_fix_toggles"


def _register_entries(host: PluginHost, info: PluginInfo) -> None:
    """Run one plugin's register hooks; keep what it registered only if all of them succeed."""
    staging = Staging(info.name, info.distribution, info.version)
    # This plugin's implementations alone (pluggy calls a hook's subset without the others).
    others = [p for p in host.pm.get_plugins() if p is not info.plugin]
    try:
        for hook_name, (attr, caps_type) in _REGISTER_HOOKS.items():
            register = staging.registrar(getattr(host.registries, attr), caps_type)
            host.pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
        host.pm.subset_hook_caller(_FIX_TOGGLE_HOOK, remove_plugins=others)(
            register=staging.fix_toggle_registrar())
    except Exception as exc:
        host.pm.unregister(name=info.name)
        host.plugins.remove(info)
        host.failures.append(
            PluginFailure(
                info.name,
                info.distribution,
                "register",
                f"{type(exc).__name__}: {exc}",
                traceback.format_exc(),
                info.version,
            )
        )
        return
    for registry, entry in staging.entries:
        if entry.name in registry:
            host.conflicts.append(duplicate_message(registry.get(entry.name), entry))
        else:
            registry.add(entry)
    for name, description in staging.fix_toggles:
        if name in host.fix_toggles:
            host.conflicts.append(f"fix toggle {name!r} is registered twice (again by plugin "
                                  f"{info.name!r}); each toggle has one owner")
        else:
            host.fix_toggles[name] = description


def builtin_module() -> ModuleType:
    return builtin


__all__ = [
    "ALLOWLIST_ENV",
    "ENTRY_POINT_GROUP",
    "PluginError",
    "PluginFailure",
    "PluginHost",
    "PluginInfo",
    "SkippedPlugin",
    "clear_plugin_hosts",
    "get_plugin_host",
    "hook_spec_names",
    "load_plugins",
    "parse_allowlist",
    "parse_plugin_options",
]
