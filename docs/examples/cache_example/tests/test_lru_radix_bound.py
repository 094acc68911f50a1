"""What this policy adds to radix: the bound. Past `max_cached_tokens` the least recently
used unlocked entries go, even though the pool has room; locked entries and the entry just
inserted stay; in an engine the cache holds at most the bound at idle and greedy output is
still transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plugserve_cache_example.cache import MAX_CACHED_TOKENS_ENV, LRURadixCache

from plugserve.pools.allocator import PagedAllocator
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts


@pytest.fixture
def cache_policy() -> str:
    return "lru_radix"


def _store(cache: LRURadixCache, alloc: PagedAllocator, tokens: list[int]) -> torch.Tensor:
    """What a finished request does: fresh slots, insert, duplicates freed."""
    page = alloc.page_size
    pages = alloc.alloc_pages(len(tokens) // page)
    assert pages is not None
    slots = torch.tensor([p * page + i for p in pages for i in range(page)])
    dup = cache.insert(tokens, slots)
    alloc.free_slots(slots[:dup])
    return slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_bound_evicts_least_recently_used_with_room_left(page_size: int) -> None:
    alloc = PagedAllocator(256, page_size)
    cache = LRURadixCache(ReqToTokenPool(1, 8, "cpu"), alloc, page_size, max_cached_tokens=24)
    a, b, c = ([k] * 12 for k in (1, 2, 3))
    _store(cache, alloc, a)
    _store(cache, alloc, b)
    assert cache.cached_tokens() == 24
    cache.match_prefix(a)  # a is now more recent than b
    _store(cache, alloc, c)  # 36 > 24: the least recently used (b) goes
    assert cache.cached_tokens() == 24 and cache.evicted_for_bound == 12
    assert cache.match_prefix(b).length == 0
    assert cache.match_prefix(a).length == cache.match_prefix(c).length == 12
    assert alloc.available_size() + 24 == alloc.total_slots  # the pool had room all along


def test_locked_entries_outlast_the_bound() -> None:
    alloc = PagedAllocator(64, 1)
    cache = LRURadixCache(ReqToTokenPool(1, 8, "cpu"), alloc, 1, max_cached_tokens=8)
    a, b = [1] * 8, [2] * 8
    _store(cache, alloc, a)
    lock = cache.match_prefix(a).node
    cache.inc_lock_ref(lock)
    _store(cache, alloc, b)  # 16 cached: a is locked, b was just inserted; both stay
    assert cache.cached_tokens() == 16
    cache.dec_lock_ref(lock)  # a is evictable again and least recently used: it goes
    assert cache.cached_tokens() == 8
    assert cache.match_prefix(a).length == 0 and cache.match_prefix(b).length == 8


def test_a_bad_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_CACHED_TOKENS_ENV, "lots")
    with pytest.raises(ValueError, match="must be a whole number of tokens >= 0, got 'lots'"):
        LRURadixCache(ReqToTokenPool(1, 8, "cpu"), PagedAllocator(4, 1), 1)


class TestBoundInAnEngine(EngineTest):
    def test_cache_stays_within_the_bound(self, cache_policy: str, tiny_model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(MAX_CACHED_TOKENS_ENV, "48")
        prompts = random_prompts(8, 256, 20, 40, seed=3)
        sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
        expected = hf_greedy(tiny_model_dir, prompts, [6] * len(prompts))
        with self.engine(model=str(tiny_model_dir), cache=cache_policy, page_size=4) as engine:
            for _ in range(2):
                out = engine.generate(prompts, sampling)
                assert [r.token_ids for r in out] == expected
                self.assert_idle_memory_whole(engine)
                stats = engine.stats()
                cached = stats["cache_evictable_slots"] + stats["cache_protected_slots"]
                assert cached <= 48, f"{cached} tokens cached at idle, bound 48"
                # The pool could hold every prompt: what went, went for the bound.
                assert stats["kv_available_slots"] > sum(len(p) + 8 for p in prompts)
