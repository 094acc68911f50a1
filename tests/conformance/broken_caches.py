"""Deliberately broken cache policies: test doubles proving that the cache-policy suite can
fail. Each is the docs' example policy (`lru_radix`, with its default bound) with one promise
of the `PrefixCache` protocol broken; registered as a plugin ("broken_caches") by the
`cache_plugins` fixture, each under its own name with the capabilities its bug needs."""

from __future__ import annotations

import heapq
from typing import Any

import torch
from plugserve_cache_example.cache import LRURadixCache

from plugserve.cache.base import MatchResult
from plugserve.hookspecs import hookimpl
from plugserve.registry import CachePolicyCapabilities


class ForgetsDuplicates(LRURadixCache):
    """`insert` reports no duplicates: the caller never frees its copies of tokens that were
    already cached, and nobody owns them any more (a leak)."""

    name = "cache_forgets_duplicates"
    capabilities = CachePolicyCapabilities()

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        super().insert(token_ids, slots)
        return 0


class EvictsLocked(LRURadixCache):
    """`evict` takes least recently used leaves whether or not a request locks them."""

    name = "cache_evicts_locked"
    capabilities = CachePolicyCapabilities()

    def evict(self, num_tokens: int) -> int:
        heap = self._leaves()
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free_slots(leaf.value)
            freed += len(leaf.key)
            if leaf.lock_ref:
                self._protected -= len(leaf.key)
            else:
                self._evictable -= len(leaf.key)
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, parent)
        return freed


class UnalignedMatch(LRURadixCache):
    """`match_prefix` drops the last matched token: with pages of one token that is a shorter
    but valid match; with bigger pages the match ends inside a page."""

    name = "cache_unaligned_match"
    capabilities = CachePolicyCapabilities()

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        match = super().match_prefix(token_ids)
        if self.page_size > 1 and match.length:
            return MatchResult(match.slots[:-1], match.node)
        return match


class PathSizeZero(LRURadixCache):
    """`path_size` says locks protect nothing, while it declares sessions (whose locks the
    idle check counts with it)."""

    name = "cache_path_size_zero"
    capabilities = CachePolicyCapabilities(sessions=True)

    def path_size(self, nodes: list[Any]) -> int:
        return 0


class NoSWASizes(LRURadixCache):
    """Declares sliding_window but keeps the base's SWA side: its entries hold SWA pages that
    its SWA sizes (0) never count."""

    name = "cache_no_swa_sizes"
    capabilities = CachePolicyCapabilities(sliding_window=True)


BROKEN: dict[str, type[LRURadixCache]] = {
    cls.name: cls for cls in (ForgetsDuplicates, EvictsLocked, UnalignedMatch, PathSizeZero,
                              NoSWASizes)
}


@hookimpl
def plugserve_register_cache_policies(register: Any) -> None:
    for name, cls in BROKEN.items():
        register(name, lambda cls=cls: cls, cls.capabilities, description=cls.__doc__ or "")
