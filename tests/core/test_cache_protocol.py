"""The PrefixCache base gives a policy without a SWA side what the SWA pool needs: sizes of 0,
SWA eviction through whole-entry eviction, the window recorded. swa_radix overrides all four
(the cache suite checks their values against the pages, tests/conformance)."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.cache.base import MatchResult, PrefixCache
from plugserve.cache.no_cache import NoCache
from plugserve.cache.swa_radix import SWARadixCache
from plugserve.pools.allocator import PagedAllocator
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator


class CountingPolicy(PrefixCache):
    """Keeps nothing; counts evictions."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.evicted: list[int] = []

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        self.evicted.append(num_tokens)
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0


def test_a_policy_without_a_swa_side_gets_the_defaults() -> None:
    policy = CountingPolicy(ReqToTokenPool(1, 4, "cpu"), HybridAllocator(8, 8, 1), 1)
    assert policy.sliding_window is None
    policy.set_sliding_window(16, frozenset())
    assert policy.sliding_window == 16
    assert policy.swa_evictable_size() == policy.swa_protected_size() == 0
    assert policy.evict_swa(5) == 0
    assert policy.evicted == [5], "evict_swa falls back to evicting whole entries"
    assert policy.path_size([None]) == 0 and policy.cached_slots() == []


def test_swa_radix_overrides_the_swa_side() -> None:
    for name in ("set_sliding_window", "swa_evictable_size", "swa_protected_size", "evict_swa",
                 "path_size", "cached_slots"):
        assert getattr(SWARadixCache, name) is not getattr(PrefixCache, name), name
    # `none` keeps nothing: the defaults are exact for it.
    for name in ("swa_evictable_size", "swa_protected_size", "evict_swa"):
        assert getattr(NoCache, name) is getattr(PrefixCache, name), name


def test_swa_radix_records_the_window_for_the_base_too() -> None:
    cache = SWARadixCache(ReqToTokenPool(1, 4, "cpu"), PagedAllocator(8, 1), 1)
    cache.set_sliding_window(24, frozenset())
    assert cache.window == cache.sliding_window == 24
