"""Registers the `eagle` speculative algorithm and its fix toggles."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterFixToggle, RegisterSpecAlgorithm, SpecCapabilities

CAPABILITIES = SpecCapabilities(
    topk_gt1=True, overlap=True, needs_draft_model=True, default_draft_for_default_model=True,
    grammar=True,  # drafts walked through a request's grammar (accept.py)
)

# The toggles this plugin owns (the fix lives in its code); registered at plugin load so an
# engine can validate PLUGSERVE_REVERT_FIX before the algorithm is imported.
FIX_TOGGLES = {
    "page_tree_row_widen": "do not widen req_to_token rows for the speculative reserve "
    "(only the verified tree fits)",
    "prefix_tail_duplicate": "page_size>1 with topk>1: do not copy the prefix's partial tail "
    "page into the first page of branches 1..topk-1",
}


def _load() -> Any:
    from plugserve_spec_eagle.algorithm import EagleAlgorithm

    return EagleAlgorithm


@hookimpl
def plugserve_register_spec_algorithms(register: RegisterSpecAlgorithm) -> None:
    register(
        "eagle",
        _load,
        CAPABILITIES,
        description="EAGLE draft model; chain (topk 1) or tree (topk>1); v1 sync, v2 overlap",
    )


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    for name, description in FIX_TOGGLES.items():
        register(name, description)

