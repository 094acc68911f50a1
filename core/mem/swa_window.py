"""The sliding-window rules of a hybrid model's SWA pool (DESIGN.md §3, §6), on the KV
manager's data.

Window eviction: a windowed layer's query at position `p` reads keys `(p - window, p]`. The
manager records, for every forward it prepares, the first position that forward queries
(`Req.swa_read_from`: a chunk's prefix, a decode's position, a speculative round's committed
length minus one). Before the next batch is built, a request frees the SWA pages wholly below
`floor_align(swa_read_from - window, page)`. Under the overlap loop the forward in flight is
the one recorded last, so what it reads is kept too; the next forward queries later still.
Never below `max(cache_protected_len, swa_evicted_seqlen)`: the cache owns the SWA pages of
the locked prefix (it tombstones them itself), and pages below `swa_evicted_seqlen` are gone.

Accounting: the SWA pool obeys the same law as the full pool; a request owns the SWA pages
of its full pages from `max(cache_protected_len, swa_evicted_seqlen)` up to
`ceil_align(kv_allocated_len, page)` (every full page it allocates gets a SWA page).
"""

from __future__ import annotations

from collections.abc import Iterable

from plugserve.fixes import FixToggle
from plugserve.pools.allocator import ceil_align, floor_align
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator
from plugserve.structs.req import Req

SWA_UNCACHED_FROM_PROTECTED = FixToggle(
    "swa_uncached_from_protected",
    "count a request's SWA uncached slots from cache_protected_len alone, ignoring the pages "
    "it freed out of the window (the checker then reports a false leak)",
)
SWA_EVICT_PARTIAL_PAGE = FixToggle(
    "swa_evict_partial_page",
    "window eviction rounds its boundary up to a page: it frees the page still read by the "
    "window (wrong tokens)",
)


class SWAWindow:
    def __init__(self, allocator: HybridAllocator, rows: ReqToTokenPool, window: int,
                 revert_fixes: frozenset[str] = frozenset()) -> None:
        self.allocator = allocator
        self.rows = rows
        self.window = window
        self.page_size = allocator.page_size
        self._uncached_from_protected = SWA_UNCACHED_FROM_PROTECTED in revert_fixes
        self._partial_page = SWA_EVICT_PARTIAL_PAGE in revert_fixes
        self.freed_slots = 0  # SWA slots freed out of windows so far (stats, tests)

    def not_owned_prefix(self, req: Req) -> int:
        """The page-aligned prefix whose SWA pages the request does not own: the cache's
        locked prefix, or what it already freed out of the window."""
        if self._uncached_from_protected:
            return req.cache_protected_len
        return max(req.cache_protected_len, req.swa_evicted_seqlen)

    def window_intact(self, row: int, length: int) -> bool:
        """Whether every SWA page of positions `[length - window, length)` of `row` is
        mapped (a request continuing from `length` reads them back)."""
        slots = self.rows.req_to_token[row, max(0, length - self.window) : length]
        pages = set((slots // self.page_size).tolist())
        return self.allocator.mapped_pages(sorted(pages)) == len(pages)

    def evict(self, reqs: Iterable[Req]) -> int:
        """Free the SWA pages that fell out of every live request's window; returns SWA slots
        freed."""
        return sum(self._evict_one(req) for req in reqs)

    def _evict_one(self, req: Req) -> int:
        row = req.req_pool_idx
        if row is None or req.finished() or req.is_retracted:
            return 0
        read_from = req.swa_read_from
        if req.pending_forwards == 0:
            # No forward in flight for it: the next one queries from its committed length on
            # (a decode, the next chunk, a speculative round), one position earlier to be safe.
            read_from = max(read_from, req.kv_committed_len - 1)
        keep_from = read_from - self.window  # keys at or past this are still read
        if self._partial_page:
            boundary = ceil_align(max(keep_from, 0), self.page_size)
        else:
            boundary = floor_align(max(keep_from, 0), self.page_size)
        boundary = min(boundary, floor_align(req.kv_committed_len, self.page_size))
        start = max(req.cache_protected_len, req.swa_evicted_seqlen)
        if boundary <= start:
            return 0
        freed = self.allocator.free_swa_of_slots(self.rows.req_to_token[row, start:boundary])
        req.swa_evicted_seqlen = boundary  # page-aligned, only grows
        self.freed_slots += freed
        return freed
