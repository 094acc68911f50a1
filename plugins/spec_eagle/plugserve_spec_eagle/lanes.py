"""EAGLE's lanes on top of the core holey layout (`plugserve.structs.holey_layout`, DESIGN.md §5).

Where each lane (branch) of a round lives in a request's row is the core's `HoleyLayout`:
with `L` the verified length, `last = L % page` and `base = L - last`, lane t owns row
positions `[base + t*stride, base + (t+1)*stride)` and draft step s (0-based) of lane t sits
at `base + t*stride + last + s`; lane 0 simply continues the prefix. What is EAGLE's own is
here:

- `copy_prefix_tail`: before drafting, lanes t >= 1 get a copy of the prefix's partial tail
  page in their first `last` positions;
- `reorder_lanes`: after re-ranking, a lane that continues another lane's path gets that
  lane's drafts;
- `lane_kv_lists`: each lane's draft forward reads the prefix's whole pages `[0, base)`, then
  its own first `last + s + 1` positions (tail copy, drafts of steps 0..s). A backend that
  reads whole pages through a page table sees exactly that; a backend reading per-query slot
  lists reads the same slots.

Every function here takes the core's 0-based draft step; `layout_step` converts EAGLE's
forward numbering to it.
"""

from __future__ import annotations

import torch

from plugserve.attention.draft_kv import DraftKVLists, indptr_from_lengths
from plugserve.pools.kv_pool import KVPool
from plugserve.structs.holey_layout import HoleyLayout

# The EAGLE algorithm builds `LaneLayout(page_size, num_steps, topk)`: it is the core layout.
LaneLayout = HoleyLayout


def layout_step(forward: int) -> int:
    """The core layout's draft step (0-based) whose KV EAGLE's draft forward `forward` writes.

    The one place EAGLE's step numbering meets the core's. EAGLE counts its draft forwards
    from 1: catch-up already produced the seed's top-k (the tree's first level), so forward 1
    feeds those tokens and writes their KV, and forward f writes the KV of the tree's level f.
    The core layout counts draft steps from 0, so forward f writes draft step f - 1.
    """
    if forward < 1:
        raise ValueError(f"EAGLE draft forwards are numbered from 1, got {forward}")
    return forward - 1


def copy_prefix_tail(
    pool: KVPool, row: torch.Tensor, layout: HoleyLayout, verified_len: int
) -> None:
    """Give every lane t >= 1 a copy of the prefix's partial tail page (positions
    `[base, L)`) in the first `last` slots of its first page."""
    last = layout.tail_len(verified_len)
    if last == 0 or layout.topk == 1:
        return
    base = layout.base(verified_len)
    src = row[base:verified_len]
    starts = layout.branch_starts(verified_len)[1:]
    dst = torch.cat([row[s : s + last] for s in starts])
    pool.copy_slots(dst, src.repeat(len(starts)))


def reorder_lanes(
    pool: KVPool, row: torch.Tensor, layout: HoleyLayout, verified_len: int, steps_done: int,
    parent_lane: list[int],
) -> None:
    """After re-ranking, lane t continues the path of lane `parent_lane[t]`: copy that lane's
    drafts of draft steps `0..steps_done - 1` into lane t."""
    moved = [t for t, p in enumerate(parent_lane) if p != t]
    if not moved or steps_done == 0:
        return

    def drafts(lane: int) -> torch.Tensor:
        first = layout.draft_position(verified_len, lane, 0)
        return row[first : first + steps_done]

    src = torch.cat([drafts(parent_lane[t]) for t in moved])
    dst = torch.cat([drafts(t) for t in moved])
    pool.copy_slots(dst, src)


def lane_kv_lists(
    rows: list[torch.Tensor], verified_lens: list[int], layout: HoleyLayout, step: int
) -> DraftKVLists:
    """Per-lane KV lists for the forward that writes draft step `step` (0-based),
    request-major: the prefix's whole pages, then the lane's first `last + step + 1`
    positions (its tail copy and its drafts of steps 0..step)."""
    parts: list[torch.Tensor] = []
    lens: list[int] = []
    for row, length in zip(rows, verified_lens, strict=True):
        prefix = row[: layout.base(length)]
        for lane, start in enumerate(layout.branch_starts(length)):
            parts.append(prefix)
            parts.append(row[start : layout.draft_position(length, lane, step) + 1])
            lens.append(length + step + 1)
    device = rows[0].device if rows else torch.device("cpu")
    indices = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    indptr = torch.tensor(indptr_from_lengths(lens), dtype=torch.int64, device=device)
    return DraftKVLists(indptr, indices, lens)
