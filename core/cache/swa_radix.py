"""`swa_radix` cache policy: the radix tree for hybrid sliding-window models (DESIGN.md §6).

Nodes hold *full* slots, as in `radix`. Each full page of a node may also have a SWA page
mapped (`plugserve.pools.swa_pool.HybridAllocator`): the windowed layers' KV of those tokens.
That SWA page can be freed on its own (*tombstoned*: unmapped) while the full slots stay, so
the tree keeps two sizes per lock state:

- full: `evictable_size` / `protected_size` (tokens of unlocked / locked nodes);
- SWA: `swa_evictable_size` / `swa_protected_size` (mapped SWA slots of those nodes).

A prefix match is accepted only as far as the last window of SWA KV is intact (every SWA page
of `[L - window, L)` mapped): a request continuing from `L` reads that window back. Eviction
is LRU per pool: full eviction removes unlocked leaves (their SWA pages go with them); SWA
eviction tombstones unlocked nodes' SWA pages.

First version: a running request's prefix is inserted only when it finishes
(`caches_unfinished = False`). A lock taken after each chunk would pin the whole prompt's SWA
KV (the window eviction never frees below the cache's locked prefix).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from plugserve.cache.base import MatchResult
from plugserve.cache.radix import _EMPTY, RadixCache, RadixNode
from plugserve.fixes import FixToggle
from plugserve.pools.allocator import PagedAllocator, floor_align
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator

SWA_MATCH_ACROSS_TOMBSTONE = FixToggle(
    "swa_match_across_tombstone",
    "swa_radix accepts a prefix match whose last window of SWA KV was tombstoned (the request "
    "then reads the padding page: wrong tokens)",
)


class SWARadixCache(RadixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, page_size: int
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        # Without a SWA pool (swa_pools=False) it is exactly `radix`.
        self.hybrid = allocator if isinstance(allocator, HybridAllocator) else None
        self.caches_unfinished = self.hybrid is None  # with a SWA pool: at finish only
        self.window: int | None = None
        self._match_across_tombstones = False
        self._swa_evictable = 0
        self._swa_protected = 0

    def set_sliding_window(self, window: int, revert_fixes: frozenset[str]) -> None:
        """Called by the engine once the model's window is known."""
        super().set_sliding_window(window, revert_fixes)
        self.window = window
        self._match_across_tombstones = SWA_MATCH_ACROSS_TOMBSTONE in revert_fixes

    # --- SWA sizes ------------------------------------------------------------------------
    def _pages(self, node: RadixNode) -> list[int]:
        return (node.value[:: self.page_size] // self.page_size).tolist()

    def _swa_slots(self, node: RadixNode) -> int:
        """SWA slots mapped to the node's full pages (0 without a SWA pool)."""
        if self.hybrid is None or node is self.root:
            return 0
        return self.hybrid.mapped_pages(self._pages(node)) * self.page_size

    def swa_path_size(self, nodes: list[Any]) -> int:
        seen: set[int] = set()
        total = 0
        for node in nodes:
            while node is not None and node is not self.root and id(node) not in seen:
                seen.add(id(node))
                total += self._swa_slots(node)
                node = node.parent
        return total

    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    # --- matching -------------------------------------------------------------------------
    def _intact_len(self, slots: torch.Tensor) -> int:
        """The longest page-aligned prefix length L of `slots` whose last window
        `[L - window, L)` has every SWA page mapped (0 if none)."""
        assert self.hybrid is not None and self.window is not None
        page = self.page_size
        pages = (slots[::page] // page).tolist()
        run = 0  # mapped pages in a row ending at the current one
        runs = []
        for p in pages:
            run = run + 1 if self.hybrid.swa_page_of(p) else 0
            runs.append(run)
        for i in range(len(pages), 0, -1):
            first_page = max(0, i * page - self.window) // page
            if runs[i - 1] >= i - first_page:
                return i * page
        return 0

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        match = super().match_prefix(token_ids)
        if self.hybrid is None or match.length == 0 or self._match_across_tombstones:
            return match
        intact = self._intact_len(match.slots)
        if intact == match.length:
            return match
        if intact == 0:
            return MatchResult(_EMPTY, self.root)
        # Walk again to the intact length: that splits the node there, so the lock covers
        # exactly the prefix the request reuses.
        tokens = token_ids[: floor_align(intact, self.page_size)]
        node, values, pos = self._walk(tokens)
        assert pos == intact, (pos, intact)
        return MatchResult(torch.cat(values) if len(values) > 1 else values[0], node)

    # --- tree changes that move SWA sizes -------------------------------------------------
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        assert len(token_ids) % self.page_size == 0, len(token_ids)
        node, _, pos = self._walk(token_ids)
        if pos < len(token_ids):
            leaf = RadixNode(list(token_ids[pos:]), slots[pos:].clone(), node)
            node.children[self._page_key(leaf.key, 0)] = leaf
            self._evictable += len(leaf.key)
            # The leaf takes over the SWA pages still mapped to its full pages (the request
            # freed those below its window already).
            self._swa_evictable += self._swa_slots(leaf)
        return pos

    def inc_lock_ref(self, node: Any) -> None:
        n = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                swa = self._swa_slots(n)
                self._swa_evictable -= swa
                self._swa_protected += swa
            n = n.parent
        super().inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        n = node
        while n is not None and n is not self.root:
            if n.lock_ref == 1:
                swa = self._swa_slots(n)
                self._swa_evictable += swa
                self._swa_protected -= swa
            n = n.parent
        super().dec_lock_ref(node)

    def evict(self, num_tokens: int) -> int:
        """Full eviction, LRU leaves first; a leaf's SWA pages are freed with it."""
        heap = [leaf for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._swa_evictable -= self._swa_slots(leaf)
            self.allocator.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        """SWA eviction: tombstone unlocked nodes' SWA pages, least recently used first; their
        full slots stay cached (a later match stops before a tombstoned window)."""
        if self.hybrid is None:
            return 0
        heap = [n for n in self._nodes() if n.lock_ref == 0 and self._swa_slots(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            node = heapq.heappop(heap)
            swa = self.hybrid.free_swa_of_pages(self._pages(node))
            self._swa_evictable -= swa
            freed += swa
        return freed

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        self.evict_swa(self._swa_evictable)
        super().reset()
