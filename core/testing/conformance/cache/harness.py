"""A cache policy on a pool of its own, driven the way the KV manager drives it, with every
promise of the `PrefixCache` protocol checked after each operation.

Between operations the harness holds no KV itself: a stored sequence is what a finished
request that matched nothing leaves behind (fresh slots, inserted, the duplicates freed, or
everything freed when the policy does not share prefixes). So the law has no request terms:

    available + evictable + protected == total          (and the same for the SWA pool)

and `evictable + protected` must be exactly what `cached_slots()` lists. Matches are checked
against what the harness stored (a match may offer less than is cached, never other slots),
locks against `path_size`, and locked slots must never be freed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from plugserve.cache.base import MatchResult
from plugserve.pools.allocator import PagedAllocator, floor_align
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.pools.swa_pool import HybridAllocator
from plugserve.testing.conformance.cache.target import CachePolicyUnderTest


@dataclass(eq=False)  # compared by identity
class Lock:
    node: Any
    slots: torch.Tensor  # the matched slots the lock protects
    swa_pages: list[int] = field(default_factory=list)  # their full pages with a SWA page


class CacheHarness:
    def __init__(self, target: CachePolicyUnderTest, page_size: int, *, num_pages: int = 40,
                 swa_pages: int = 0, window: int | None = None) -> None:
        self.page = page_size
        self.sharing = target.capabilities.prefix_sharing
        self.hybrid = HybridAllocator(num_pages, swa_pages, page_size) if swa_pages else None
        self.allocator = self.hybrid or PagedAllocator(num_pages, page_size)
        self.window = window
        self.cache = target.build(ReqToTokenPool(2, 8, "cpu"), self.allocator, page_size)
        if window is not None:
            self.cache.set_sliding_window(window, frozenset())
        self.locks: list[Lock] = []
        # Page-aligned prefix (its tokens) -> the slots of its last page, as stored.
        self.recorded: dict[tuple[int, ...], torch.Tensor] = {}

    # --- operations -------------------------------------------------------------------------
    def store(self, tokens: list[int]) -> int | None:
        """A finished request's page-aligned `tokens` on fresh slots: inserted (duplicates
        freed) or, without prefix sharing, freed. Returns the duplicates the policy reported,
        or None when the pool has no room even after eviction."""
        n, page = len(tokens), self.page
        assert n % page == 0 and n > 0
        pages = self._alloc(n // page)
        if pages is None:
            return None
        slots = torch.tensor([p * page + i for p in pages for i in range(page)],
                             dtype=torch.int64)
        if self.hybrid is not None and self.window is not None:
            # The request already freed the SWA pages that fell out of its window.
            self.hybrid.free_swa_of_slots(slots[: floor_align(max(0, n - self.window), page)])
        if not self.sharing:
            self.allocator.free_slots(slots)
            return 0
        dup = self.cache.insert(list(tokens), slots)
        assert isinstance(dup, int) and 0 <= dup <= n and dup % page == 0, (
            f"insert of {n} tokens returned {dup!r}: it must be the number of leading tokens "
            f"already cached, a whole number of pages ({page}) between 0 and {n}")
        self.allocator.free_slots(slots[:dup])
        for i in range(dup // page, n // page):
            self.recorded[tuple(tokens[: (i + 1) * page])] = slots[i * page : (i + 1) * page]
        if self.cache.caches_unfinished:
            whole = self.match(tokens).length
            assert whole == n, (
                f"right after inserting {n} tokens a match of them returned {whole}: the KV "
                "manager relocks a running request on what it inserted (caches_unfinished)")
        return dup

    def _alloc(self, num_pages: int) -> list[int] | None:
        pages = self.allocator.alloc_pages(num_pages)
        if pages is None:  # make room as the KV manager does: evict, then retry
            self.cache.evict(num_pages * self.page)
            if self.hybrid is not None:
                short = num_pages * self.page - self.hybrid.swa.available_size()
                if short > 0:
                    self.cache.evict_swa(short)
            self.check()
            pages = self.allocator.alloc_pages(num_pages)
        return pages

    def match(self, query: list[int]) -> MatchResult:
        m = self.cache.match_prefix(list(query))
        length, page = m.length, self.page
        assert isinstance(m.slots, torch.Tensor) and m.slots.dim() == 1 and (
            m.slots.dtype == torch.int64), "MatchResult.slots must be a 1-d int64 tensor"
        assert length % page == 0 and 0 <= length <= len(query), (
            f"a match of {len(query)} tokens returned {length}: it must be a whole number of "
            f"pages ({page}) and no longer than the query")
        if not self.sharing:
            assert length == 0, f"a policy without prefix sharing matched {length} tokens"
        free = set(self.allocator.free_pages)
        for i in range(length // page):
            got = m.slots[i * page : (i + 1) * page]
            want = self.recorded.get(tuple(query[: (i + 1) * page]))
            assert want is not None and torch.equal(got, want), (
                f"page {i} of a {length}-token match returned slots {got.tolist()}, but "
                f"{'these tokens were never stored' if want is None else want.tolist()} "
                "(a match must return the slots stored for exactly these tokens)")
            assert int(got[0]) // page not in free, f"a match returned free page {int(got[0])}"
        if self.hybrid is not None and self.window is not None and length:
            self._check_window_intact(m.slots)
        return m

    def _check_window_intact(self, slots: torch.Tensor) -> None:
        """A request continuing after a match reads the match's last window back."""
        assert self.hybrid is not None and self.window is not None
        length, page = int(slots.shape[0]), self.page
        first = floor_align(max(0, length - self.window), page)
        for pos in range(first, length, page):
            p = int(slots[pos]) // page
            assert self.hybrid.swa_page_of(p), (
                f"a {length}-token match includes position {pos} of its last window "
                f"[{length - self.window}, {length}) whose SWA page is gone: the request would "
                "read the padding page (match only as far as the last window is intact)")

    def lock(self, query: list[int]) -> Lock:
        m = self.match(query)
        self.cache.inc_lock_ref(m.node)
        pages = (m.slots[:: self.page] // self.page).tolist()
        swa = [p for p in pages if self.hybrid is not None and self.hybrid.swa_page_of(p)]
        lock = Lock(m.node, m.slots.clone(), swa)
        self.locks.append(lock)
        return lock

    def unlock(self, lock: Lock) -> None:
        self.locks.remove(lock)
        self.cache.dec_lock_ref(lock.node)

    def evict(self, num_tokens: int) -> int:
        before, evictable = self.allocator.available_size(), self.cache.evictable_size()
        freed = self.cache.evict(num_tokens)
        gained = self.allocator.available_size() - before
        assert freed == gained, (f"evict({num_tokens}) returned {freed} but {gained} slots "
                                 "came back to the pool")
        assert freed >= min(num_tokens, evictable), (
            f"evict({num_tokens}) freed {freed} of {evictable} evictable slots")
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        assert self.hybrid is not None
        before = self.hybrid.swa.available_size()
        evictable = self.cache.swa_evictable_size()
        self.cache.evict_swa(num_tokens)
        gained = self.hybrid.swa.available_size() - before
        assert gained >= min(num_tokens, evictable), (
            f"evict_swa({num_tokens}) freed {gained} of {evictable} evictable SWA slots")
        return gained

    # --- the promises -----------------------------------------------------------------------
    def check(self) -> None:
        cache, alloc, page = self.cache, self.allocator, self.page
        evictable, protected = cache.evictable_size(), cache.protected_size()
        chunks = cache.cached_slots()
        stored = sum(int(c.numel()) for c in chunks)
        assert evictable >= 0 and protected >= 0, (evictable, protected)
        assert evictable + protected == stored, (
            f"evictable {evictable} + protected {protected} != {stored} slots listed by "
            "cached_slots(): every stored slot is in exactly one of the two sizes")
        assert alloc.available_size() + evictable + protected == alloc.total_slots, (
            f"law broken: available {alloc.available_size()} + evictable {evictable} + "
            f"protected {protected} != total {alloc.total_slots} (nothing else holds KV)")
        free = alloc.free_pages
        assert len(free) == len(set(free)), "a page is in the free list twice (double free)"
        cached: list[int] = []
        for chunk in chunks:
            values = chunk.tolist()
            assert len(values) % page == 0, f"a cached entry of {len(values)} slots (page {page})"
            for i in range(0, len(values), page):
                p = values[i] // page
                assert values[i : i + page] == list(range(p * page, p * page + page)), (
                    f"cached slots {values[i:i + page]} are not one whole page")
                cached.append(p)
        assert len(cached) == len(set(cached)), "cached_slots() lists a page twice"
        used_free = set(cached) & set(free)
        assert not used_free, f"cached page(s) {sorted(used_free)[:8]} are also free"
        nodes = [lock.node for lock in self.locks]
        path = cache.path_size(nodes)
        assert protected == path, (
            f"protected {protected} != path_size of the locked nodes {path}: with only these "
            "locks held, what they protect is exactly the protected size")
        for lock in self.locks:
            pages = set((lock.slots // page).tolist())
            assert not pages & set(free), "a locked entry's page was freed"
        if self.hybrid is not None:
            self._check_swa(cached)

    def _check_swa(self, cached: list[int]) -> None:
        assert self.hybrid is not None
        cache, swa = self.cache, self.hybrid.swa
        evictable, protected = cache.swa_evictable_size(), cache.swa_protected_size()
        mapped = sum(1 for p in cached if self.hybrid.swa_page_of(p)) * self.page
        assert evictable >= 0 and protected >= 0, (evictable, protected)
        assert evictable + protected == mapped, (
            f"SWA evictable {evictable} + protected {protected} != {mapped} SWA slots mapped to "
            "the cached pages")
        assert swa.available_size() + evictable + protected == swa.total_slots, (
            f"SWA law broken: available {swa.available_size()} + evictable {evictable} + "
            f"protected {protected} != total {swa.total_slots}")
        for lock in self.locks:
            gone = [p for p in lock.swa_pages if not self.hybrid.swa_page_of(p)]
            assert not gone, f"a locked entry's SWA page(s) were freed (full pages {gone})"


def random_sequence(rng: random.Random, known: list[list[int]], page: int) -> list[int]:
    """A page-aligned token sequence over a small alphabet: often a cut of a known one
    (anywhere, also mid-page) continued differently, so prefixes share, split and diverge."""
    length = rng.randint(1, 6) * page
    head: list[int] = []
    if known and rng.random() < 0.6:
        base = rng.choice(known)
        head = base[: rng.randint(0, len(base))]
    return (head + [rng.randrange(3) for _ in range(length)])[:length]


def run_random_operations(harness: CacheHarness, seed: int, steps: int = 150) -> dict[str, int]:
    """Stores, matches, locks, unlocks, evictions and resets in a seeded random order, every
    promise checked after each. Returns how often each operation ran."""
    rng = random.Random(seed)
    known: list[list[int]] = []
    done = dict.fromkeys(("store", "match", "lock", "unlock", "evict", "evict_swa", "reset"), 0)
    ops, weights = ["store", "match", "lock", "unlock", "evict", "reset"], [6, 3, 3, 2, 1, 0.3]
    if harness.hybrid is not None:
        ops.append("evict_swa")
        weights.append(1.5)
    for _ in range(steps):
        op = rng.choices(ops, weights)[0]
        if op == "store":
            tokens = random_sequence(rng, known, harness.page)
            if tokens and harness.store(tokens) is not None:
                known.append(tokens)
        elif op in ("match", "lock") and known:
            query = rng.choice(known)
            query = query[: rng.randint(0, len(query) + 2)] + [rng.randrange(3)] * rng.randint(
                0, 2)
            if op == "lock":
                harness.lock(query)
            else:
                harness.match(query)
        elif op == "unlock" and harness.locks:
            harness.unlock(rng.choice(harness.locks))
        elif op == "evict":
            harness.evict(rng.randint(1, 4) * harness.page)
        elif op == "evict_swa":
            harness.evict_swa(rng.randint(1, 3) * harness.page)
        elif op == "reset":
            harness.cache.reset()
            assert harness.cache.evictable_size() == 0, "reset() left unlocked entries"
        else:
            continue
        done[op] += 1
        harness.check()
    for lock in list(harness.locks):
        harness.unlock(lock)
        harness.check()
    return done
