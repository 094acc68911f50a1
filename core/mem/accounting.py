"""One accounted KV pool and the terms of its conservation law (DESIGN.md §3).

The KV manager holds a list of `AccountedPool`s (today the full-attention pool; a hybrid
sliding-window model adds its SWA pool with its own counters). Each reports its own terms:

    available + evictable + protected + session_held + uncached == total
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plugserve.pools.allocator import PagedAllocator, ceil_align
from plugserve.structs.req import Req


def no_slots() -> int:
    return 0


def no_eviction(num_tokens: int) -> int:
    return 0


def _protected_prefix(req: Req) -> int:
    return req.cache_protected_len


@dataclass(frozen=True)
class PoolTerms:
    """The conservation terms of one pool at one instant, in KV slots (tokens)."""

    pool: str
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int
    total: int

    @property
    def balance(self) -> int:
        """Zero when the law holds; > 0 = slots counted twice, < 0 = slots lost."""
        return (
            self.available + self.evictable + self.protected + self.session_held + self.uncached
            - self.total
        )

    def describe(self) -> str:
        return (
            f"pool {self.pool!r}: available {self.available} + evictable {self.evictable} + "
            f"protected {self.protected} + session_held {self.session_held} + uncached "
            f"{self.uncached} = {self.total + self.balance}, total {self.total} "
            f"(off by {self.balance:+d})"
        )

    def line(self) -> str:
        """The compact form a log line or a ring-buffer dump uses."""
        return (
            f"{self.pool}: avail={self.available} evict={self.evictable} prot={self.protected} "
            f"sess={self.session_held} uncached={self.uncached} total={self.total}"
        )


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
    session_held: Callable[[], int] = no_slots
    # Ask the prefix cache to free at least this many of the pool's slots (LRU); returns
    # slots freed. Full eviction removes entries; SWA eviction tombstones their SWA pages.
    evict: Callable[[int], int] = no_eviction

    @property
    def total(self) -> int:
        return self.allocator.total_slots

    def req_uncached(self, req: Req) -> int:
        """Slots the request owns outright: whole pages up to its allocation, minus the prefix
        it does not own."""
        page = self.allocator.page_size
        return ceil_align(req.kv_allocated_len, page) - self.req_not_owned_prefix(req)

    def terms(self, reqs: Iterable[Req]) -> PoolTerms:
        """The law's terms with `reqs` as the requests that own KV right now (none at idle)."""
        return PoolTerms(
            pool=self.name,
            available=self.allocator.available_size(),
            evictable=self.evictable_size(),
            protected=self.protected_size(),
            session_held=self.session_held(),
            uncached=sum(self.req_uncached(req) for req in reqs),
            total=self.total,
        )
