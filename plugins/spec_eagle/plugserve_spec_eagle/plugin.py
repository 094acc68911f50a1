"""Registers the `eagle` speculative algorithm, its fix toggles and its row width."""

from __future__ import annotations

from typing import Any

from plugserve import fixes
from plugserve.config import EngineConfig
from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterFixToggle, RegisterSpecAlgorithm, SpecCapabilities
from plugserve.spec.alloc import extra_row_width

CAPABILITIES = SpecCapabilities(
    topk_gt1=True, overlap=True, needs_draft_model=True, default_draft_for_default_model=True
)

FIX_TOGGLES = {
    "spec_v2_bonus_preclaim": "overlap loop: do not pre-claim the bonus slot when a round is "
    "prepared; resolve adds the whole accept length one step late",
    "page_tree_row_widen": "do not widen req_to_token rows for the speculative reserve "
    "(only the verified tree fits)",
    "prefix_tail_duplicate": "page_size>1 with topk>1: do not copy the prefix's partial tail "
    "page into the first page of branches 1..topk-1",
    "spec_topk_busy_check_skip": "the invariant checker skips its busy-step check when "
    "spec_topk > 1",
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


@hookimpl
def plugserve_extra_row_width(config: EngineConfig) -> int | None:
    if config.spec != "eagle":
        return None
    if fixes.reverted("page_tree_row_widen"):
        return config.num_draft_tokens  # the old width: the verified tree only
    return extra_row_width(config)
