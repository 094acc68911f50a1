"""Prefix-cache protocol and the request release rules of DESIGN.md §4.

A cache policy decides which KV survives a request. The release rules (what is inserted,
what is a duplicate, what is freed from where) live here once, next to the data they change,
so every policy obeys the same conservation law.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from plugserve import fixes
from plugserve.mem.allocator import PagedAllocator, ceil_align, floor_align
from plugserve.mem.req_to_token import ReqToTokenPool
from plugserve.sched.req import Req


@dataclass
class MatchResult:
    slots: torch.Tensor  # KV slots of the matched, page-aligned prefix
    node: Any  # node to lock for the request (None when nothing is cached)

    @property
    def length(self) -> int:
        return int(self.slots.shape[0])


class PrefixCache(ABC):
    shares_prefixes: bool = True

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, page_size: int
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size

    # --- policy-specific --------------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult: ...

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Insert a page-aligned prefix; return how many leading tokens were already cached
        (their slots in `slots` are duplicates the caller frees)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached slots if possible; return slots freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def reset(self) -> None:
        """Drop every unlocked entry (used when the engine is flushed)."""
        self.evict(self.evictable_size())

    # --- the release rules (shared by all policies) -----------------------------------------
    def cache_finished_req(self, req: Req) -> None:
        """A request ended (finish or abort): keep its committed prefix, free the rest."""
        row = req.req_pool_idx
        assert row is not None, f"{req} has no row to release"
        page = self.page_size
        committed, allocated = req.kv_committed_len, req.kv_allocated_len
        slots = self.req_to_token_pool.req_to_token[row, :allocated].clone()
        aligned = floor_align(committed, page)
        if self.shares_prefixes:
            already_cached = self.insert(req.all_ids[:aligned], slots[:aligned])
            self.allocator.free_slots(slots[req.cache_protected_len : already_cached])
        else:
            self.allocator.free_slots(slots[req.cache_protected_len : aligned])
        self.allocator.free_slots(slots[aligned:committed])  # the unaligned tail page
        req.kv_committed_freed = True
        # Over-allocation starts on the next page boundary: the tail page was freed above.
        overalloc_start = (
            committed if fixes.reverted("finish_overalloc_unaligned") else ceil_align(committed, page)
        )
        if allocated > overalloc_start:
            self.allocator.free_slots(slots[overalloc_start:allocated])
        req.kv_overallocated_freed = True
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.finish_released = True

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: cache the page-aligned committed prefix and lock it for the
        request; the unaligned tail stays with the request."""
        if not self.shares_prefixes:
            return
        row = req.req_pool_idx
        assert row is not None
        aligned = floor_align(req.kv_committed_len, self.page_size)
        if aligned <= req.cache_protected_len:
            return
        slots = self.req_to_token_pool.req_to_token[row, :aligned].clone()
        token_ids = req.all_ids[:aligned]
        already_cached = self.insert(token_ids, slots)
        self.allocator.free_slots(slots[req.cache_protected_len : already_cached])
        match = self.match_prefix(token_ids)
        assert match.length == aligned, (match.length, aligned)
        self.req_to_token_pool.write(
            row, req.cache_protected_len, match.slots[req.cache_protected_len :]
        )
        self.inc_lock_ref(match.node)
        self.dec_lock_ref(req.last_node)
        req.last_node = match.node
        req.prefix_slots = match.slots
        req.cache_protected_len = aligned

    def release_retracted(self, req: Req) -> None:
        """Retract: release the request's KV *without* caching it, keep its tokens."""
        row = req.req_pool_idx
        assert row is not None
        slots = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].clone()
        # Its own slots: everything past the locked (page-aligned) prefix, whole pages.
        self.allocator.free_slots(slots[req.cache_protected_len :])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
