"""How many KV slots one speculative decode round may touch (DESIGN.md §5).

A round drafts `num_steps` tokens on `topk` branches and verifies `num_draft_tokens` tree
nodes, all in slots past the request's committed KV. With page_size 1, or a chain, that is
`max(num_steps * topk, num_draft_tokens)` slots. With page_size > 1 and topk > 1 each branch
owns whole pages from the prefix's page-aligned base (the holey layout), `n` pages per branch,
so a round may touch `n * page * topk` slots counted from that base. The scheduler keeps twice
that much allocated ahead of the committed length: under the overlap loop the round being
prepared starts where the round still in flight ends, which is known only later.
"""

from __future__ import annotations

from plugserve.config import EngineConfig


def pages_per_branch(page_size: int, num_steps: int) -> int:
    """Whole pages each branch owns after the prefix's page-aligned base."""
    return -(-(page_size - 1 + num_steps) // page_size)


def branch_stride(page_size: int, num_steps: int, topk: int) -> int:
    """Row positions between the starts of two branches of one request."""
    if topk == 1:
        return 0
    if page_size == 1:
        return num_steps
    return pages_per_branch(page_size, num_steps) * page_size


def alloc_len_per_decode(config: EngineConfig) -> int:
    steps, topk, page = config.spec_steps, config.spec_topk, config.page_size
    ndt = config.num_draft_tokens
    if page == 1 or topk == 1:
        return max(steps * topk, ndt)
    return max(pages_per_branch(page, steps) * page * topk, ndt)


def reserve_len(config: EngineConfig) -> int:
    """Slots kept allocated past the committed length before each round (2x the round)."""
    return 2 * alloc_len_per_decode(config)


def extra_row_width(config: EngineConfig) -> int:
    """Row width beyond the context a speculative engine needs: the reserve plus a page."""
    return reserve_len(config) + config.page_size
