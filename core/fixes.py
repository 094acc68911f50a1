"""Fix toggles: `PLUGSERVE_REVERT_FIX=name[,name]` puts a fixed accounting bug back.

Each toggle names one rule of DESIGN.md whose violation leaked KV or produced wrong tokens.
Tests turn a toggle on to prove the checker (or an output comparison) catches the old
behaviour, and off to prove the fix holds.

The module that owns a fix defines its toggle as a constant (`FixToggle`: a name that carries
its description). Every plugin registers the toggles it owns through the same hook,
`plugserve_register_fix_toggles` (the core's through its built-in plugin), so the set of known
toggles is the loaded plugins' (`PluginHost.fix_toggles`), whatever was imported. The requested
toggles are read once, at start-up, into `EngineConfig.revert_fixes`; code on hot paths only
tests membership in that frozenset, never the environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

ENV_VAR = "PLUGSERVE_REVERT_FIX"


class FixToggle(str):
    """A toggle's name (it compares and hashes as the plain string) with its description."""

    description: str

    def __new__(cls, name: str, description: str) -> FixToggle:
        toggle = super().__new__(cls, name)
        toggle.description = description
        return toggle


def parse_reverts(raw: str | Iterable[str] | None) -> frozenset[str]:
    """`"a, b"` or `["a", "b"]` -> frozenset({"a", "b"}) (blanks dropped)."""
    if raw is None:
        return frozenset()
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    return frozenset(part.strip() for part in parts if part.strip())


def unknown_reverts(requested: frozenset[str], known: Mapping[str, str]) -> list[str]:
    """Reasons the requested toggles cannot be honoured (a typo would silently pass);
    `known` is what the loaded plugins registered."""
    unknown = sorted(requested - set(known))
    if not unknown:
        return []
    return [
        f"{ENV_VAR} names unknown fix toggle(s) {', '.join(unknown)}; "
        f"known: {', '.join(sorted(known))}"
    ]
