"""Prefix-cache protocol: which KV survives a request (docs/cache_policies.md).

A policy is a data structure of token ids -> KV slots with locks and eviction. It never
decides what a request frees: the release rules (what is inserted, what is a duplicate, what
is freed from where) live once in the KV manager (`plugserve.mem.manager`), so every policy
obeys the same conservation law. What a policy answers is two of the law's terms per pool:

    available + evictable + protected + session_held + uncached == total

`evictable_size()` + `protected_size()` must equal the slots the policy stores (the lengths of
`cached_slots()`): every stored slot is in exactly one of them, unlocked or locked. Slots the
policy lets go go back through `self.allocator.free_slots`, and nowhere else.

Whether a policy shares prefixes, runs sliding-window models or serves streaming sessions is
its registered `plugserve.registry.CachePolicyCapabilities`, not an attribute here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.pools.allocator import PagedAllocator
from plugserve.pools.req_to_token import ReqToTokenPool


@dataclass
class MatchResult:
    slots: torch.Tensor  # KV slots of the matched, page-aligned prefix
    node: Any  # node to lock for the request (None when nothing is cached)

    @property
    def length(self) -> int:
        return int(self.slots.shape[0])


class PrefixCache(ABC):
    """The protocol every cache policy implements. Sizes count KV slots (= tokens); every
    length the policy stores or returns is a whole number of pages (`page_size` tokens).

    Built once per engine as `cls(req_to_token_pool, allocator, page_size)`. `allocator` is
    the full pool's (a `plugserve.pools.swa_pool.HybridAllocator` when the model keeps its
    windowed layers in a separate SWA pool; see the sliding-window side below).
    """

    # When the KV manager inserts a running request's page-aligned prefix. True: after each
    # prefill chunk and after the prefill (the request then locks the inserted node, and those
    # slots move from its `uncached` term to the cache's `protected` term: later requests
    # share them while it still runs). False: only when it finishes; until then the request
    # owns its prefix (`uncached`). The law holds either way.
    caches_unfinished: bool = True

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, page_size: int
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.sliding_window: int | None = None  # set by set_sliding_window

    # --- policy-specific --------------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached prefix of `token_ids` the policy offers: a whole number of pages
        (at most `len(token_ids)`), its slots in token order, and the node a request locks to
        keep them. Nothing cached: length 0 and a node that `inc_lock_ref` accepts (None or
        a root). A policy may offer less than it holds (never more); it must not change the
        sizes (splitting a node is fine)."""

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Store a page-aligned prefix and its slots; return how many leading tokens were
        already cached (a whole number of pages). The policy keeps `slots[returned:]` (they
        become evictable); `slots[:returned]` are duplicates that the caller frees (or already
        owns through its lock). Right after an insert, `match_prefix(token_ids)` matches all
        of `token_ids` (the manager relocks a running request on it). An insert may free other
        unlocked entries (e.g. to keep a bound), never a locked one nor what it just stored."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Lock `node` and everything a match through it returned: those slots become
        protected. Locks nest (counted); `node` None locks nothing."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one `inc_lock_ref(node)`; a slot no lock holds any more becomes evictable."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached slots if that many are evictable (all of
        them otherwise), through `self.allocator.free_slots`; return slots freed. Locked slots
        are never freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Stored slots no lock holds."""

    @abstractmethod
    def protected_size(self) -> int:
        """Stored slots some lock holds."""

    def reset(self) -> None:
        """Drop every unlocked entry (used when the engine is flushed)."""
        self.evict(self.evictable_size())

    def path_size(self, nodes: list[Any]) -> int:
        """Slots on the union of the paths from the root to `nodes`: what locking each of
        them protects, counted once. With only these nodes locked, `protected_size()` equals
        it. Streaming sessions lean on it: at idle the cache may protect exactly
        `path_size(open sessions' nodes)` (the checker fails otherwise). A policy that keeps
        nothing returns 0."""
        return 0

    def swa_path_size(self, nodes: list[Any]) -> int:
        """Sliding-window-pool slots still mapped on the union of the paths from the root to
        `nodes` (what locking them protects in the SWA pool); 0 without a SWA pool."""
        return 0

    def cached_slots(self) -> list[torch.Tensor]:
        """Every slot the cache stores, each once (their lengths add up to `evictable_size()
        + protected_size()`). The checker's physical checks treat their pages as held: a
        cached page in the free list is a use after free. A policy that keeps nothing
        returns []."""
        return []

    # --- sliding-window side ----------------------------------------------------------------
    # A hybrid sliding-window model keeps its windowed layers' KV in a second accounted pool,
    # the SWA pool (docs/architecture.md). `self.allocator` is then a HybridAllocator: every
    # full page the cache holds may also have a SWA page mapped, which the cache can free on
    # its own ("tombstone") while the full slots stay. The SWA pool's law reads the two sizes
    # below. The defaults are exact for a policy that stores nothing, and for one that never
    # runs with a SWA pool (a policy that does not declare `sliding_window` never does); a
    # policy that declares it and stores KV must override them (swa_radix is the reference).

    def set_sliding_window(self, window: int, revert_fixes: frozenset[str]) -> None:
        """Called once at start-up, before any request, when the model has sliding-window
        layers (`window`: the largest window in tokens), whether or not a SWA pool exists.
        `revert_fixes` are the engine's fix toggles. The default records the window."""
        self.sliding_window = window

    def swa_evictable_size(self) -> int:
        """SWA slots mapped to the full pages of unlocked entries (0 without a SWA pool)."""
        return 0

    def swa_protected_size(self) -> int:
        """SWA slots mapped to the full pages of locked entries (0 without a SWA pool)."""
        return 0

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` SWA slots of unlocked entries if possible; return SWA
        slots freed. A policy with its own SWA side tombstones (frees only the SWA pages,
        keeping the full slots; a later match must then stop where the last window is no
        longer mapped). The default evicts whole entries (`evict`: their SWA pages go with
        their full pages) and returns what `evict` returns."""
        return self.evict(num_tokens)
