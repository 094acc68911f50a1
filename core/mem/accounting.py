"""What an invariant checker needs to account one KV pool (DESIGN.md §3).

The engine builds one `AccountedPool` per KV pool (today the full-attention pool; a hybrid
sliding-window model adds its SWA pool with its own counters). The conservation law per pool:

    available + evictable + protected + session_held + uncached == total
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plugserve.mem.allocator import PagedAllocator, ceil_align
from plugserve.sched.req import Req


def _no_slots() -> int:
    return 0


def _protected_prefix(req: Req) -> int:
    return req.cache_protected_len


@dataclass
class AccountedPool:
    name: str
    allocator: PagedAllocator
    evictable_size: Callable[[], int]
    protected_size: Callable[[], int]
    # The page-aligned prefix of a request that is *not* its own: owned by the cache (full
    # pool) or already freed out of the window (SWA pool: max(protected, swa_evicted)).
    req_not_owned_prefix: Callable[[Req], int] = _protected_prefix
    # KV parked in session slots that are not lent to a request in a batch.
    session_held: Callable[[], int] = _no_slots
    session_held_rows: Callable[[], int] = _no_slots

    @property
    def total(self) -> int:
        return self.allocator.total_slots

    def req_uncached(self, req: Req) -> int:
        """Slots the request owns outright: whole pages up to its allocation, minus the prefix
        it does not own."""
        page = self.allocator.page_size
        return ceil_align(req.kv_allocated_len, page) - self.req_not_owned_prefix(req)
