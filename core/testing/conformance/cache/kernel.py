"""Kernel-level cache suite: the policy's data structure on a pool of its own (see
`harness`), every promise of the `PrefixCache` protocol checked after each operation."""

from __future__ import annotations

import pytest
import torch

from plugserve.testing.conformance.cache.base import CacheConformanceTest
from plugserve.testing.conformance.cache.harness import CacheHarness, run_random_operations
from plugserve.testing.conformance.requirements import requires

__all__ = ["TestCacheKernel", "TestCacheKernelSlidingWindow"]

PAGES = pytest.mark.parametrize("page_size", [1, 4], ids=lambda p: f"page{p}")
SEEDS = pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
WINDOW = {1: 3, 4: 6}  # tokens, per page size: a window spanning two to three pages


class TestCacheKernel(CacheConformanceTest):
    @PAGES
    def test_a_new_cache_stores_nothing(self, page_size: int) -> None:
        h = CacheHarness(self.target, page_size)
        h.check()
        assert h.cache.evictable_size() == h.cache.protected_size() == 0
        assert h.match(list(range(3 * page_size))).length == 0

    @PAGES
    @SEEDS
    def test_random_operations_keep_the_law(self, page_size: int, seed: int) -> None:
        """Inserts, matches, locks, unlocks, evictions and resets in a random order: the law,
        the sizes against what is stored, locks against path_size, matches against what was
        stored, after every operation."""
        done = run_random_operations(CacheHarness(self.target, page_size), seed)
        assert done["store"] > 10 and done["lock"] > 3, done

    @requires("prefix_sharing")
    @PAGES
    def test_duplicates_are_reported(self, page_size: int) -> None:
        h, page = CacheHarness(self.target, page_size), page_size
        a = [1] * (2 * page) + [2] * page
        assert h.store(a) == 0
        assert h.store(a) == len(a), "inserting cached tokens again must report them cached"
        longer = [*a, *([3] * page)]
        assert h.store(longer) == len(a), "the cached prefix of a longer insert is a duplicate"
        fork = [*a[: 2 * page], *([4] * page)]
        assert h.store(fork) == 2 * page, "an insert diverging after two pages shares two"
        if page > 1:  # diverging inside a page shares only the whole pages before it
            mid = [*a[: 2 * page + 1], *([5] * (page - 1))]
            assert h.store(mid) == 2 * page
        h.check()

    @requires("prefix_sharing")
    @PAGES
    def test_matches_are_whole_pages_of_stored_slots(self, page_size: int) -> None:
        h, page = CacheHarness(self.target, page_size), page_size
        tokens = [7, 1, 4, 4, 2, 9, 6, 3, 8, 5, 0, 2][: 3 * page] * 2
        h.store(tokens[: 3 * page])
        for n in range(len(tokens) + 1):
            m = h.match(tokens[:n])  # page alignment and slots are checked there
            assert m.length == min(n, 3 * page) // page * page, (
                f"a match of {n} tokens returned {m.length}, right after the first "
                f"{3 * page} were inserted")

    @requires("prefix_sharing")
    @PAGES
    def test_locked_entries_survive_eviction(self, page_size: int) -> None:
        h, page = CacheHarness(self.target, page_size), page_size
        kept, other = [1] * (3 * page), [2] * (2 * page)
        h.store(kept)
        h.store(other)
        lock = h.lock(kept)
        protected = h.cache.protected_size()
        assert protected == 3 * page, f"locking a {3 * page}-token match protects {protected}"
        h.evict(h.allocator.total_slots)  # everything evictable goes
        h.check()
        assert h.cache.evictable_size() == 0
        assert torch.equal(h.match(kept).slots, lock.slots), "a locked entry was evicted"
        assert h.match(other).length == 0, "an unlocked entry survived evicting everything"
        h.unlock(lock)
        h.check()
        assert h.cache.protected_size() == 0 and h.cache.evictable_size() == 3 * page
        h.cache.reset()
        h.check()
        assert h.allocator.available_size() == h.allocator.total_slots

    @requires("prefix_sharing")
    @PAGES
    def test_nested_locks_count(self, page_size: int) -> None:
        """Two requests lock the same prefix; the first unlock must keep it protected."""
        h, page = CacheHarness(self.target, page_size), page_size
        tokens = [3] * (2 * page)
        h.store(tokens)
        first, second = h.lock(tokens), h.lock(tokens[:page])
        h.unlock(first)
        h.check()
        assert h.cache.protected_size() == page
        h.evict(h.allocator.total_slots)
        h.check()
        assert h.match(tokens).length == page, "the prefix still locked by one request went"
        h.unlock(second)
        h.check()


class TestCacheKernelSlidingWindow(CacheConformanceTest):
    """With a SWA pool (a HybridAllocator): both pools' laws, SWA sizes that follow the mapped
    pages, tombstones that spare locked entries, matches whose last window is intact."""

    @requires("sliding_window")
    @PAGES
    @SEEDS
    def test_random_operations_keep_both_laws(self, page_size: int, seed: int) -> None:
        h = CacheHarness(self.target, page_size, swa_pages=40, window=WINDOW[page_size])
        done = run_random_operations(h, seed)
        assert done["store"] > 10 and done["evict_swa"] > 3, done

    @requires("sliding_window", "prefix_sharing")
    @PAGES
    def test_tombstones_spare_locks_and_stop_matches(self, page_size: int) -> None:
        page, window = page_size, WINDOW[page_size]
        h = CacheHarness(self.target, page_size, swa_pages=40, window=window)
        kept, other = [1] * (4 * page), [2] * (4 * page)
        h.store(kept)
        h.store(other)
        lock = h.lock(kept)
        h.evict_swa(h.allocator.total_slots)  # every unlocked SWA page goes
        h.check()
        assert h.cache.swa_evictable_size() == 0
        assert h.match(kept).length == 4 * page, "the locked entry lost its window"
        h.match(other)  # the window check is in match
        h.unlock(lock)
        h.check()
