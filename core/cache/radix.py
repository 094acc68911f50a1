"""`radix` cache policy: a page-aligned radix tree of token ids -> KV slots.

Every edge holds a whole number of pages. Nodes locked by live requests are *protected*; the
rest are *evictable*, evicted least recently used first, leaves before their parents.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from plugserve.cache.base import MatchResult, PrefixCache
from plugserve.pools.allocator import PagedAllocator, floor_align
from plugserve.pools.req_to_token import ReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64)
_clock = itertools.count()


class RadixNode:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


class RadixCache(PrefixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, page_size: int
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.root = RadixNode([], _EMPTY, None)
        self.root.lock_ref = 1  # never evicted
        self._evictable = 0
        self._protected = 0

    def _page_key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _shared_len(self, key: list[int], tokens: list[int], start: int) -> int:
        """Tokens shared by `key` and tokens[start:], rounded down to whole pages."""
        limit = min(len(key), len(tokens) - start)
        n = 0
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return floor_align(n, self.page_size)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` tokens; return the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[:at], node.value[:at], parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.key = node.key[at:]
        node.value = node.value[at:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        parent.children[self._page_key(upper.key, 0)] = upper
        return upper

    def _walk(self, tokens: list[int]) -> tuple[RadixNode, list[torch.Tensor], int]:
        node, values, pos = self.root, [], 0
        stamp = next(_clock)
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            shared = self._shared_len(child.key, tokens, pos)
            if shared == 0:
                break
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = stamp
            values.append(child.value)
            pos += shared
            node = child
        return node, values, pos

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        tokens = token_ids[: floor_align(len(token_ids), self.page_size)]
        node, values, _ = self._walk(tokens)
        if node is self.root:
            return MatchResult(_EMPTY, self.root)
        return MatchResult(torch.cat(values) if len(values) > 1 else values[0], node)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        assert len(token_ids) % self.page_size == 0, len(token_ids)
        node, _, pos = self._walk(token_ids)
        if pos < len(token_ids):
            leaf = RadixNode(list(token_ids[pos:]), slots[pos:].clone(), node)
            node.children[self._page_key(leaf.key, 0)] = leaf
            self._evictable += len(leaf.key)
        return pos

    def inc_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "radix node unlocked more often than locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        heap = [leaf for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def path_size(self, nodes: list[Any]) -> int:
        seen: set[int] = set()
        total = 0
        for node in nodes:
            while node is not None and node is not self.root and id(node) not in seen:
                seen.add(id(node))
                total += len(node.key)
                node = node.parent
        return total

    def cached_slots(self) -> list[torch.Tensor]:
        """Every slot the tree holds (for physical checks)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node.value)
            stack.extend(node.children.values())
        return out
