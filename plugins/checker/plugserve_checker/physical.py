"""Physical checks (PLUGSERVE_CHECK_PAGES=1): lengths, use after free, double free, and
every live request's cached prefix locked."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.pools.swa_pool import HybridAllocator
from plugserve.structs.req import Req
from plugserve_checker.errors import KVCorruptionError


def check_pages(scheduler: Any, reqs: list[Req]) -> None:
    """`reqs` own KV right now (none at idle). Every pool's free list holds each page once;
    the full pool's pages held by a request, a session slot or the prefix cache are not
    free."""
    kv = scheduler.kv
    for pool in kv.pools:
        free = pool.allocator.free_pages
        if len(set(free)) != len(free):
            seen: set[int] = set()
            twice = sorted({p for p in free if p in seen or seen.add(p)})  # type: ignore[func-returns-value]
            raise KVCorruptionError(
                f"double free in pool {pool.name!r}: page(s) {twice[:8]} are in the free list "
                "twice"
            )
    rows = kv.rows
    page = kv.page_size
    owned: dict[int, str] = {}
    for req in reqs:
        if not 0 <= req.kv_committed_len <= req.kv_allocated_len <= rows.row_width:
            raise KVCorruptionError(
                f"request {req.rid}: need 0 <= committed ({req.kv_committed_len}) <= allocated "
                f"({req.kv_allocated_len}) <= row width ({rows.row_width})"
            )
        assert req.req_pool_idx is not None
        slots = rows.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        for p in set((slots // page).tolist()):
            owned.setdefault(p, f"request {req.rid}")
    if kv.sessions is not None:
        for slot in kv.sessions.store.slots.values():
            if slot.row is not None and not slot.lent:
                slots = rows.req_to_token[slot.row, slot.cache_protected_len : slot.kv_committed_len]
                for p in set((slots // page).tolist()):
                    owned.setdefault(p, f"session {slot.session_id}")
    for value in kv.cache.cached_slots():
        for p in set((value // page).tolist()):
            owned.setdefault(p, "the prefix cache")
    free_set = set(kv.full.allocator.free_pages)
    used_free = sorted(p for p in owned if p in free_set)
    if used_free:
        p = used_free[0]
        raise KVCorruptionError(
            f"use after free: page {p} of pool 'full' is held by {owned[p]} and also in the "
            f"free list ({len(used_free)} such page(s))"
        )
    if isinstance(kv.full.allocator, HybridAllocator):
        _check_swa_pages(kv.full.allocator, owned, free_set)
    _check_prefixes_locked(kv, reqs)


def _check_prefixes_locked(kv: Any, reqs: list[Req]) -> None:
    """The slots of live requests' protected prefixes (shared ones, e.g. the samples of an
    n > 1 request that forked one prompt, counted once) are all locked by the prefix cache:
    a request that reads cached pages without holding a lock leaves them evictable, and the
    cache would hand them out while it still reads them."""
    prefixes = [kv.rows.req_to_token[r.req_pool_idx, : r.cache_protected_len]
                for r in reqs if r.cache_protected_len and r.req_pool_idx is not None]
    if not prefixes:
        return
    needed = int(torch.unique(torch.cat(prefixes)).numel())
    locked = kv.cache.protected_size()
    if needed > locked:
        forked = sorted(r.rid for r in reqs if r.fork_parent is not None)
        raise KVCorruptionError(
            f"unlocked prefix: live requests' protected prefixes cover {needed} cached slots "
            f"but the prefix cache locks only {locked}; a request reads cached pages it holds "
            f"no lock on (forked samples among them: {forked[:8]})"
        )


def _check_swa_pages(alloc: HybridAllocator, owned: dict[int, str], full_free: set[int]) -> None:
    """The SWA pool: a SWA page mapped to a held full page is not free, no SWA page is
    mapped twice, and a free full page has no SWA page left mapped (it would be lost)."""
    swa_free = set(alloc.swa.free_pages)
    mapped_by: dict[int, int] = {}
    for p in range(1, alloc.num_pages + 1):
        s = alloc.swa_page_of(p)
        if not s:
            continue
        if s in mapped_by:
            raise KVCorruptionError(
                f"pool 'swa': page {s} is mapped to full pages {mapped_by[s]} and {p}"
            )
        mapped_by[s] = p
        if p in full_free:
            raise KVCorruptionError(
                f"pool 'swa': free full page {p} still maps SWA page {s} (never freed)"
            )
        if s in swa_free:
            raise KVCorruptionError(
                f"use after free: page {s} of pool 'swa' is mapped to full page {p} held by "
                f"{owned.get(p, 'nobody')} and also in the free list"
            )
