"""`lru_radix`: the built-in radix tree with a bound on how many tokens it keeps.

A shared serving box may not want the prefix cache to grow until the KV pool is full: the
cached KV of old conversations then competes with running requests, and every admission pays
for evicting it. This policy keeps at most `max_cached_tokens` cached tokens (locked or not)
and evicts the least recently used unlocked entries past that bound, even while the pool has
room. Locked entries (prefixes running requests use) are never evicted for the bound, nor is
the entry an insert just stored, so while requests lock more than the bound the cache holds
more and shrinks back as they finish.

It uses only the `PrefixCache` protocol of the tree it extends: the bound is enforced after
`insert` (with the inserted path locked for the moment, so it is kept) and after
`dec_lock_ref` (an unlock can make entries evictable), through `evict`, which frees LRU leaves
through the allocator. The conservation law needs nothing more: evicted slots go back to the
pool, and the sizes stay exact.

The bound comes from `PLUGSERVE_LRU_RADIX_MAX_CACHED_TOKENS` (default 4096 tokens), read when
the engine builds the policy.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from plugserve.cache.radix import RadixCache
from plugserve.pools.allocator import PagedAllocator
from plugserve.pools.req_to_token import ReqToTokenPool

MAX_CACHED_TOKENS_ENV = "PLUGSERVE_LRU_RADIX_MAX_CACHED_TOKENS"
DEFAULT_MAX_CACHED_TOKENS = 4096


def max_cached_tokens_from_env() -> int:
    raw = os.environ.get(MAX_CACHED_TOKENS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_CACHED_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MAX_CACHED_TOKENS_ENV} must be a whole number of tokens >= 0, "
                         f"got {raw!r}")
    return value


class LRURadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator,
                 page_size: int, max_cached_tokens: int | None = None) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.max_cached_tokens = (max_cached_tokens_from_env() if max_cached_tokens is None
                                  else max_cached_tokens)
        self.evicted_for_bound = 0  # tokens evicted to keep the bound (not for room)

    def cached_tokens(self) -> int:
        return self.evictable_size() + self.protected_size()

    def _enforce_bound(self) -> None:
        over = self.cached_tokens() - self.max_cached_tokens
        if over > 0 and self.evictable_size() > 0:
            self.evicted_for_bound += self.evict(over)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        already_cached = super().insert(token_ids, slots)
        # Keep what was just stored: the KV manager matches and locks it right away.
        node = self.match_prefix(token_ids).node
        self.inc_lock_ref(node)
        self._enforce_bound()
        super().dec_lock_ref(node)
        return already_cached

    def dec_lock_ref(self, node: Any) -> None:
        super().dec_lock_ref(node)
        self._enforce_bound()
