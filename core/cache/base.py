"""Prefix-cache protocol: which KV survives a request.

A policy is a data structure of token ids -> KV slots with locks and eviction. It never
decides what a request frees: the release rules (what is inserted, what is a duplicate, what
is freed from where) live once in the KV manager (`plugserve.mem.manager`), so every policy
obeys the same conservation law. Whether a policy shares prefixes at all is its registered
`CachePolicyCapabilities.prefix_sharing`, not an attribute here.
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
    # Whether a running request's aligned prefix is inserted (and locked) after each chunk
    # and after its prefill; False = only when it finishes.
    caches_unfinished: bool = True

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

    def path_size(self, nodes: list[Any]) -> int:
        """Slots on the union of the paths from the root to `nodes` (what locking each of
        them protects); a policy that keeps nothing returns 0."""
        return 0

    def swa_path_size(self, nodes: list[Any]) -> int:
        """Sliding-window-pool slots still mapped on the union of the paths from the root to
        `nodes` (what locking them protects in the SWA pool); 0 without a SWA pool."""
        return 0

    def cached_slots(self) -> list[torch.Tensor]:
        """Every slot the cache holds (for physical checks); a policy that keeps nothing
        returns []."""
        return []
