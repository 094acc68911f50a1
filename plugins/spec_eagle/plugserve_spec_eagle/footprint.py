"""EAGLE's KV footprint: how many slots one round may touch (DESIGN.md §5).

A round drafts `num_steps` tokens on `topk` branches and verifies `num_draft_tokens` tree
nodes, all in slots past the request's committed KV. With page_size 1, or a chain, that is
`max(num_steps * topk, num_draft_tokens)` slots. With page_size > 1 and topk > 1 each branch
owns whole pages from the prefix's page-aligned base (the holey layout), `n` pages per branch,
so a round may touch `n * page * topk` slots counted from that base.
"""

from __future__ import annotations

from plugserve.config import EngineConfig
from plugserve.structs.holey_layout import pages_per_branch
from plugserve.structs.spec_footprint import SpecFootprint

PAGE_TREE_ROW_WIDEN = "page_tree_row_widen"  # registered in plugin.FIX_TOGGLES


def alloc_len_per_decode(config: EngineConfig) -> int:
    steps, topk, page = config.spec_steps, config.spec_topk, config.page_size
    ndt = config.num_draft_tokens
    if page == 1 or topk == 1:
        return max(steps * topk, ndt)
    return max(pages_per_branch(page, steps) * page * topk, ndt)


def eagle_footprint(config: EngineConfig) -> SpecFootprint:
    footprint = SpecFootprint.for_round(alloc_len_per_decode(config), config.page_size)
    if PAGE_TREE_ROW_WIDEN in config.revert_fixes:
        # The old width: the verified tree only, so the reserve falls outside the row.
        return SpecFootprint(footprint.alloc_len_per_decode, footprint.reserve_len,
                             config.num_draft_tokens)
    return footprint
