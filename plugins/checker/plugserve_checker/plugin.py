"""Registers the `kv_conservation` invariant checker."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterFixToggle, RegisterInvariantChecker

SPEC_TOPK_BUSY_CHECK_SKIP = "spec_topk_busy_check_skip"


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


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    register(SPEC_TOPK_BUSY_CHECK_SKIP,
             "the invariant checker skips its busy-step check when spec_topk > 1")
