"""Registers the `kv_conservation` invariant checker."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterInvariantChecker


def _load() -> Any:
    from plugserve_checker.checker import KVConservationChecker

    return KVConservationChecker


@hookimpl
def plugserve_register_invariant_checkers(register: RegisterInvariantChecker) -> None:
    register(
        "kv_conservation",
        _load,
        description="per-pool KV conservation after every busy step and at idle",
    )
