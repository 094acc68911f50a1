"""Decode preparation and retract (DESIGN.md §4).

Before a decode forward runs, each request claims the slot it writes (committed += 1,
allocated += 1). When the pool cannot give every request its slot, the cache is evicted
first; then victims are retracted: their KV is released without being cached, their lengths
reset, and they go back to the front of the waiting queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve import fixes
from plugserve.runner.forward_batch import ForwardMode
from plugserve.sched.batch import ScheduleBatch
from plugserve.sched.req import Req

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler


def _pages_for_decode(sched: Scheduler, reqs: list[Req]) -> int:
    alloc = sched.allocator
    if sched.spec is not None:
        from plugserve.sched.spec_decode import target_allocated_len

        return sum(alloc.pages_needed(r.kv_allocated_len, target_allocated_len(sched, r))
                   for r in reqs)
    return sum(alloc.pages_needed(r.kv_allocated_len, r.kv_allocated_len + 1) for r in reqs)


def retract_victim(sched: Scheduler, req: Req) -> None:
    sched.tree_cache.release_retracted(req)
    if not fixes.reverted("retract_no_reset"):
        req.reset_for_retract()
    req.is_retracted = True
    req.retract_count += 1
    sched.stats["retracted_reqs"] += 1


def make_room_for_decode(sched: Scheduler, batch: ScheduleBatch) -> list[Req]:
    """Evict, then retract until every remaining request has its next slot. Returns the
    retracted requests (already removed from `batch`)."""
    page = sched.page_size
    need = _pages_for_decode(sched, batch.reqs)
    short = need * page - sched.allocator.available_size()
    if short > 0:
        sched.tree_cache.evict(short)
    retracted: list[Req] = []
    # Victims: fewest decoded tokens first, and among those the longest prompt, so the most
    # decoded requests with the shortest prompts are retracted last.
    order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)),
                   reverse=True)
    while need * page > sched.allocator.available_size() and len(order) > 1:
        victim = order.pop()
        retract_victim(sched, victim)
        retracted.append(victim)
        need = _pages_for_decode(sched, order)
        short = need * page - sched.allocator.available_size()
        if short > 0:
            sched.tree_cache.evict(short)
    if need * page > sched.allocator.available_size():
        raise RuntimeError(
            f"KV pool of {sched.allocator.total_slots} slots cannot hold even one running "
            f"request ({order[0] if order else None}); raise kv_pool_tokens"
        )
    keep = set(map(id, order))
    batch.reqs = [r for r in batch.reqs if id(r) in keep]
    return retracted


def prepare_decode(sched: Scheduler, batch: ScheduleBatch) -> None:
    """Claim one slot per request and lay out the decode inputs."""
    batch.mode = ForwardMode.DECODE
    batch.input_ids, batch.positions, batch.out_cache_loc = [], [], []
    batch.prefix_lens, batch.extend_lens, batch.sample_mask = [], [], []
    append_decode(sched, batch, batch.reqs)
    batch.refresh_rows()


def append_decode(sched: Scheduler, batch: ScheduleBatch, reqs: list[Req]) -> None:
    """Claim the slot each request's next forward writes and append its one-token layout."""
    from plugserve.sched.prefill import _last_slot

    for req in reqs:
        pos = req.kv_allocated_len
        slots = sched.allocator.extend_slots(_last_slot(sched, req), pos, pos + 1)
        assert slots is not None, "make_room_for_decode guarantees a slot"
        assert req.req_pool_idx is not None
        sched.req_to_token_pool.write(req.req_pool_idx, pos, slots)
        req.kv_allocated_len += 1
        req.kv_committed_len += 1
        batch.input_ids.append(sched.next_input_token(req))
        batch.positions.append(pos)
        batch.out_cache_loc.append(slots[0])
        batch.prefix_lens.append(pos)
        batch.extend_lens.append(1)
        batch.sample_mask.append(True)
