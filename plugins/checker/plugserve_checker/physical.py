"""Physical checks (PLUGSERVE_CHECK_PAGES=1): lengths, use after free, double free."""

from __future__ import annotations

from typing import Any

from plugserve.sched.req import Req
from plugserve_checker.errors import KVCorruptionError


def check_pages(scheduler: Any, reqs: list[Req]) -> None:
    pool = scheduler.req_to_token_pool
    allocator = scheduler.allocator
    page = allocator.page_size
    free = allocator.free_pages
    free_set = set(free)
    if len(free_set) != len(free):
        seen: set[int] = set()
        twice = sorted({p for p in free if p in seen or seen.add(p)})  # type: ignore[func-returns-value]
        raise KVCorruptionError(f"double free: page(s) {twice[:8]} are in the free list twice")
    owned: dict[int, str] = {}
    for req in reqs:
        if not 0 <= req.kv_committed_len <= req.kv_allocated_len <= pool.row_width:
            raise KVCorruptionError(
                f"request {req.rid}: need 0 <= committed ({req.kv_committed_len}) <= allocated "
                f"({req.kv_allocated_len}) <= row width ({pool.row_width})"
            )
        assert req.req_pool_idx is not None
        slots = pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        for p in set((slots // page).tolist()):
            owned.setdefault(p, f"request {req.rid}")
    cached = getattr(scheduler.tree_cache, "cached_slots", None)
    if cached is not None:
        for value in cached():
            for p in set((value // page).tolist()):
                owned.setdefault(p, "the prefix cache")
    used_free = sorted(p for p in owned if p in free_set)
    if used_free:
        p = used_free[0]
        raise KVCorruptionError(
            f"use after free: page {p} is held by {owned[p]} and also in the free list "
            f"({len(used_free)} such page(s))"
        )
