"""Fix toggles: `PLUGSERVE_REVERT_FIX=name[,name]` puts a fixed accounting bug back.

Each toggle names one rule of DESIGN.md whose violation leaked KV or produced wrong tokens.
Tests turn a toggle on to prove the checker (or an output comparison) catches the old
behaviour, and off to prove the fix holds.

A toggle is declared by the module that owns the fix (`declare_fix_toggle` at import time in
core; the `plugserve_register_fix_toggles` hook in plugins). The requested toggles are read
once, at start-up, into `EngineConfig.revert_fixes`; code on hot paths only tests membership
in that frozenset, never the environment.
"""

from __future__ import annotations

from collections.abc import Iterable

ENV_VAR = "PLUGSERVE_REVERT_FIX"

_known: dict[str, str] = {}


def declare_fix_toggle(name: str, description: str) -> str:
    """Declare a toggle (idempotent); returns `name` so the owner can keep it as a constant."""
    _known.setdefault(name, description)
    return name


def known_fix_toggles() -> dict[str, str]:
    return dict(_known)


def parse_reverts(raw: str | Iterable[str] | None) -> frozenset[str]:
    """`"a, b"` or `["a", "b"]` -> frozenset({"a", "b"}) (blanks dropped)."""
    if raw is None:
        return frozenset()
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    return frozenset(part.strip() for part in parts if part.strip())


def unknown_reverts(requested: frozenset[str]) -> list[str]:
    """Reasons the requested toggles cannot be honoured: a typo would silently pass."""
    unknown = sorted(requested - set(_known))
    if not unknown:
        return []
    return [
        f"{ENV_VAR} names unknown fix toggle(s) {', '.join(unknown)}; "
        f"known: {', '.join(sorted(_known))}"
    ]
