"""Prefill adder: picks waiting requests (and the chunked one) into one extend batch.

Rules (DESIGN.md §4, applied by the KV manager): a prefill's matched prefix is page-aligned
and locked; committed = allocated = prefix + extend; a request too long for the token budget
is chunked at a page boundary, and between chunks its aligned prefix is cached as unfinished.
Every prefill, a continuing chunk too, leaves room for each running request's next decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plugserve.pools.allocator import floor_align
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req
from plugserve.structs.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler


def decode_pages_per_req(sched: Scheduler) -> int:
    """Pages one running request may take in its next decode step: one page, or a
    speculative round's whole reserve."""
    if sched.spec_kv is None:
        return 1
    return -(-sched.spec_kv.reserve_len // sched.page_size) + 1


def build_prefill_batch(sched: Scheduler) -> ScheduleBatch | None:
    cfg = sched.config
    page = sched.page_size
    budget = cfg.chunked_prefill_size or cfg.max_prefill_tokens
    chunking = cfg.chunked_prefill_size > 0
    batch = ScheduleBatch(torch.empty(0, dtype=torch.int64), [], ForwardMode.EXTEND)

    kv = sched.kv

    def add(req: Req, prefix_len: int, extend_len: int, final: bool) -> bool:
        slots = kv.extend(req, extend_len)
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
    running = len(sched.running_batch.reqs)
    # A chunked request continues first, keeping room for every running request's next
    # decode step: a long prompt must not push running decodes into retract.
    if sched.chunked_req is not None:
        req = sched.chunked_req
        prefix_len = req.kv_committed_len
        remaining = req.seq_len - prefix_len
        take = remaining if remaining <= budget else floor_align(budget, page)
        need = kv.pages_to_grow(req, req.kv_allocated_len + take)
        if take > 0 and kv.ensure_free_pages(need + running * decode_pages_per_req(sched)):
            ok = add(req, prefix_len, take, final=take == remaining)
            assert ok
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
        elif take > 0 and (running or sched.has_inflight):
            # The decodes (or the forward in flight) run first: they finish and give memory
            # back, and a request is never retracted while a forward still writes its row.
            return None
        elif take > 0:
            # Out of memory mid-prompt with nothing else running: give the chunk's KV back
            # (its cached prefix stays in the cache) and retry from the queue.
            kv.retract(req)
            sched.stats["retracted_reqs"] += 1
            sched.chunked_req = None
            sched.waiting.appendleft(req)
            return None

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
        if not kv.admit(req):
            break
        prefix_len = req.kv_committed_len
        remaining = req.seq_len - prefix_len
        # Keep room for every running request's next decode step (one page, or a
        # speculative round's whole reserve).
        reserve_pages = (running + len(batch.reqs)) * decode_pages_per_req(sched)
        if remaining <= budget:
            take, final = remaining, True
        elif chunking:
            take, final = floor_align(budget, page), False
        else:
            take, final = remaining, True  # no chunking: a long prompt goes alone
            if batch.reqs:
                kv.unadmit(req)
                break
        need_pages = kv.pages_to_grow(req, req.kv_allocated_len + take)
        if take <= 0 or not kv.ensure_free_pages(need_pages + reserve_pages):
            kv.unadmit(req)
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
