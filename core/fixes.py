"""Fix toggles: `PLUGSERVE_REVERT_FIX=name[,name]` puts a fixed accounting bug back.

Each toggle names one rule of DESIGN.md whose violation leaked KV or produced wrong tokens.
Tests turn a toggle on to prove the checker (or an output comparison) catches the old
behaviour, and off to prove the fix holds. Plugins add their own toggles through the
`plugserve_register_fix_toggles` hook.
"""

from __future__ import annotations

import os

ENV_VAR = "PLUGSERVE_REVERT_FIX"

_known: dict[str, str] = {
    "batch_identity": "count the running batch by ==, not by identity, next to the last batch",
    "finish_overalloc_unaligned": "free over-allocation from the committed length, "
    "not from its page boundary",
    "retract_no_reset": "retract a request without resetting its KV lengths",
}


def register_fix_toggle(name: str, description: str) -> None:
    _known.setdefault(name, description)


def known_fix_toggles() -> dict[str, str]:
    return dict(_known)


def requested_reverts() -> frozenset[str]:
    raw = os.environ.get(ENV_VAR, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def check_requested_reverts() -> None:
    """Raise if the environment names a toggle nobody registered (a typo would silently pass)."""
    unknown = sorted(requested_reverts() - set(_known))
    if unknown:
        raise ValueError(
            f"{ENV_VAR} names unknown fix toggle(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_known))}"
        )


def reverted(name: str) -> bool:
    """True when the old (wrong) behaviour of fix `name` is requested."""
    return name in requested_reverts()
