"""`none` cache policy: nothing survives a request; every release frees all of its KV."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.cache.base import MatchResult, PrefixCache

_EMPTY = torch.empty(0, dtype=torch.int64)


class NoCache(PrefixCache):
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(_EMPTY, None)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0
