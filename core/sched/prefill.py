"""Prefill adder: picks waiting requests (and the chunked one) into one extend batch.

Rules (DESIGN.md §4): a prefill's matched prefix is page-aligned and locked; committed =
allocated = prefix + extend; a request too long for the token budget is chunked at a page
boundary, and between chunks its aligned prefix is cached as unfinished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plugserve.mem.allocator import floor_align
from plugserve.runner.forward_batch import ForwardMode
from plugserve.sched.batch import ScheduleBatch
from plugserve.sched.req import Req

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler


def _last_slot(sched: Scheduler, req: Req) -> int:
    if req.kv_allocated_len == 0:
        return -1
    assert req.req_pool_idx is not None
    return int(sched.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_allocated_len - 1])


def _ensure_pages(sched: Scheduler, num_pages: int) -> bool:
    """Make `num_pages` free pages, evicting unlocked cache entries if needed."""
    page = sched.page_size
    short = num_pages * page - sched.allocator.available_size()
    if short > 0:
        sched.tree_cache.evict(short)
    return sched.allocator.available_size() >= num_pages * page


def _extend(sched: Scheduler, req: Req, extend_len: int) -> list[int] | None:
    """Allocate slots for `extend_len` new tokens after the request's committed KV."""
    old = req.kv_allocated_len
    need = sched.allocator.pages_needed(old, old + extend_len)
    if not _ensure_pages(sched, need):
        return None
    slots = sched.allocator.extend_slots(_last_slot(sched, req), old, old + extend_len)
    assert slots is not None
    assert req.req_pool_idx is not None
    sched.req_to_token_pool.write(req.req_pool_idx, old, slots)
    req.kv_allocated_len = old + extend_len
    req.kv_committed_len = old + extend_len
    return slots


def _admit(sched: Scheduler, req: Req) -> bool:
    """Give a waiting request a row and its cached prefix. False if no row is free."""
    if req.kv_allocated_len or req.req_pool_idx is not None:
        raise RuntimeError(
            f"request {req.rid} enters prefill still holding KV state (row {req.req_pool_idx}, "
            f"committed {req.kv_committed_len}, allocated {req.kv_allocated_len}); a retract "
            "must reset its lengths"
        )
    row = sched.req_to_token_pool.alloc()
    if row is None:
        return False
    fill = req.all_ids
    match = sched.tree_cache.match_prefix(fill[:-1])
    req.req_pool_idx = row
    req.is_retracted = False
    req.prefix_slots = match.slots
    req.last_node = match.node
    sched.tree_cache.inc_lock_ref(match.node)
    if match.length:
        sched.req_to_token_pool.write(row, 0, match.slots)
    req.cache_protected_len = match.length
    req.kv_committed_len = req.kv_allocated_len = match.length
    return True


def _decode_pages_per_req(sched: Scheduler) -> int:
    if sched.spec is None:
        return 1
    from plugserve.spec.alloc import reserve_len

    return -(-reserve_len(sched.config) // sched.page_size) + 1


def _unadmit(sched: Scheduler, req: Req) -> None:
    """Undo `_admit` for a request that got no memory this step (nothing else was taken)."""
    assert req.req_pool_idx is not None
    sched.tree_cache.dec_lock_ref(req.last_node)
    sched.req_to_token_pool.free(req.req_pool_idx)
    req.reset_for_retract()


def build_prefill_batch(sched: Scheduler) -> ScheduleBatch | None:
    cfg = sched.config
    page = sched.page_size
    budget = cfg.chunked_prefill_size or cfg.max_prefill_tokens
    chunking = cfg.chunked_prefill_size > 0
    batch = ScheduleBatch(torch.empty(0, dtype=torch.int64), [], ForwardMode.EXTEND)

    def add(req: Req, prefix_len: int, extend_len: int, final: bool) -> bool:
        slots = _extend(sched, req, extend_len)
        if slots is None:
            return False
        fill = req.all_ids
        sched.stats["prefill_tokens"] += extend_len
        batch.reqs.append(req)
        batch.input_ids.extend(fill[prefix_len : prefix_len + extend_len])
        batch.positions.extend(range(prefix_len, prefix_len + extend_len))
        batch.out_cache_loc.extend(slots)
        batch.prefix_lens.append(prefix_len)
        batch.extend_lens.append(extend_len)
        batch.sample_mask.append(final)
        return True

    # Prompts this batch computes, so no other request computes the same long prefix.
    in_batch = _InBatchPrefixes(page)
    # A chunked request continues first.
    if sched.chunked_req is not None:
        req = sched.chunked_req
        prefix_len = req.kv_committed_len
        remaining = req.seq_len - prefix_len
        take = remaining if remaining <= budget else floor_align(budget, page)
        if take > 0 and add(req, prefix_len, take, final=take == remaining):
            in_batch.add(req, prefix_len)
            budget -= take
            if take == remaining:
                req.is_chunked = 0
                sched.chunked_req = None
            else:
                req.is_chunked += 1
            if sched.chunked_req is not None:
                batch.refresh_rows()
                return batch
        elif take > 0:
            # Out of memory mid-prompt: give the chunk's KV back (its cached prefix stays in the
            # cache) and retry the request from the queue once memory frees up.
            from plugserve.sched.decode import retract_victim

            retract_victim(sched, req)
            sched.chunked_req = None
            sched.waiting.appendleft(req)
            return None

    running = len(sched.running_batch.reqs)
    deferred: list[Req] = []
    while sched.waiting and budget > 0:
        if running + len(batch.reqs) >= cfg.max_running_requests:
            break
        req = sched.waiting[0]
        if in_batch.computes_prefix_of(req):
            # Another request of this batch is computing the same long prefix: wait one step
            # and reuse it from the cache instead of computing it twice.
            deferred.append(sched.waiting.popleft())
            continue
        if not _admit(sched, req):
            break
        prefix_len = req.kv_committed_len
        remaining = req.seq_len - prefix_len
        # Keep room for every running request's next decode step (one page, or a
        # speculative round's whole reserve).
        reserve_pages = (running + len(batch.reqs)) * _decode_pages_per_req(sched)
        if remaining <= budget:
            take, final = remaining, True
        elif chunking:
            take, final = floor_align(budget, page), False
        else:
            take, final = remaining, True  # no chunking: a long prompt goes alone
            if batch.reqs:
                _unadmit(sched, req)
                break
        need_pages = sched.allocator.pages_needed(req.kv_allocated_len,
                                                  req.kv_allocated_len + take)
        if take <= 0 or not _ensure_pages(sched, need_pages + reserve_pages):
            _unadmit(sched, req)
            break
        sched.waiting.popleft()
        ok = add(req, prefix_len, take, final)
        assert ok
        budget -= take
        in_batch.add(req, prefix_len)
        if not final:
            req.is_chunked += 1
            sched.chunked_req = req
            break
    for req in reversed(deferred):
        sched.waiting.appendleft(req)
    if not batch.reqs:
        return None
    batch.refresh_rows()
    return batch


class _InBatchPrefixes:
    """Prompts already in the batch being built, to spot a long prefix computed twice."""

    MIN_SHARED = 32  # tokens of a new, uncached shared prefix worth waiting a step for

    def __init__(self, page_size: int) -> None:
        self.key_len = max(self.MIN_SHARED, page_size)
        self.by_head: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}

    def add(self, req: Req, cached_len: int) -> None:
        ids = req.all_ids
        if len(ids) > self.key_len:
            self.by_head.setdefault(tuple(ids[: self.key_len]), []).append((ids, cached_len))

    def computes_prefix_of(self, req: Req) -> bool:
        ids = req.all_ids
        others = self.by_head.get(tuple(ids[: self.key_len]))
        if not others:
            return False
        for other, cached_len in others:
            shared = _common_prefix_len(ids[:-1], other)
            if shared - cached_len >= self.key_len:
                return True
        return False


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
