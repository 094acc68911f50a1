"""Where a round's draft tokens live in a request's row (DESIGN.md §5, the holey layout).

With `L` the verified length, `last = L % page` and `base = L - last`, branch (lane) t owns
row positions `[base + t*stride, base + (t+1)*stride)`; the draft token of step s (s >= 1:
the forwards after the first top-k) sits at `base + t*stride + last + s - 1`. Lane 0 simply
continues the prefix. A lane reads the prefix's whole pages `[0, base)`, then its own first
`last + s` positions: for lanes t >= 1 the first `last` of those are a copy of the prefix's
partial tail page, made before drafting. A backend that reads whole pages through a page
table sees exactly that; a backend reading per-query slot lists reads the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.attention.draft_kv import DraftKVLists, indptr_from_lengths
from plugserve.mem.kv_pool import KVPool
from plugserve.spec.alloc import branch_stride


@dataclass(frozen=True)
class LaneLayout:
    page_size: int
    num_steps: int
    topk: int

    @property
    def stride(self) -> int:
        return branch_stride(self.page_size, self.num_steps, self.topk)

    def lane_starts(self, verified_len: int) -> list[int]:
        base = verified_len - verified_len % self.page_size
        return [base + t * self.stride for t in range(self.topk)]

    def step_positions(self, verified_len: int, step: int) -> list[int]:
        """Row position each lane's draft token of `step` (>= 1) is written at."""
        last = verified_len % self.page_size
        return [start + last + step - 1 for start in self.lane_starts(verified_len)]


def copy_prefix_tail(
    pool: KVPool, row: torch.Tensor, layout: LaneLayout, verified_len: int
) -> None:
    """Give every lane t >= 1 a copy of the prefix's partial tail page (positions
    `[base, L)`) in the first `last` slots of its first page."""
    last = verified_len % layout.page_size
    if last == 0 or layout.topk == 1:
        return
    base = verified_len - last
    src = row[base:verified_len]
    starts = layout.lane_starts(verified_len)[1:]
    dst = torch.cat([row[s : s + last] for s in starts])
    pool.copy_slots(dst, src.repeat(len(starts)))


def reorder_lanes(
    pool: KVPool, row: torch.Tensor, layout: LaneLayout, verified_len: int, steps_done: int,
    parent_lane: list[int],
) -> None:
    """After re-ranking, lane t continues the path of lane `parent_lane[t]`: copy that lane's
    draft tokens of steps 1..steps_done into lane t."""
    moved = [t for t, p in enumerate(parent_lane) if p != t]
    if not moved or steps_done == 0:
        return
    last = verified_len % layout.page_size
    starts = layout.lane_starts(verified_len)
    src = torch.cat([row[starts[parent_lane[t]] + last : starts[parent_lane[t]] + last
                         + steps_done] for t in moved])
    dst = torch.cat([row[starts[t] + last : starts[t] + last + steps_done] for t in moved])
    pool.copy_slots(dst, src)


def lane_kv_lists(
    rows: list[torch.Tensor], verified_lens: list[int], layout: LaneLayout, step: int
) -> DraftKVLists:
    """Per-lane KV lists for draft step `step` (>= 1), request-major: the prefix's whole
    pages, then the lane's first `last + step` positions (its tail copy and its drafts)."""
    parts: list[torch.Tensor] = []
    lens: list[int] = []
    for row, length in zip(rows, verified_lens, strict=True):
        last = length % layout.page_size
        base = length - last
        prefix = row[:base]
        for start in layout.lane_starts(length):
            parts.append(prefix)
            parts.append(row[start : start + last + step])
            lens.append(length + step)
    device = rows[0].device if rows else torch.device("cpu")
    indices = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    indptr = torch.tensor(indptr_from_lengths(lens), dtype=torch.int64, device=device)
    return DraftKVLists(indptr, indices, lens)
