"""Decode preparation and retract (DESIGN.md §4).

Before a decode forward runs, each request claims the slot it writes (committed += 1,
allocated += 1). When the pool cannot give every request its slot, the cache is evicted
first; under the overlap loop the forward in flight is then resolved (finished requests give
their memory back only then); only then are victims retracted: their KV is released without
being cached, their lengths reset, and they go back to the front of the waiting queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req
from plugserve.structs.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler


def _pages_for_decode(sched: Scheduler, reqs: list[Req]) -> int:
    kv, spec_kv = sched.kv, sched.spec_kv
    if spec_kv is not None:
        return sum(kv.pages_to_grow(r, spec_kv.target_allocated_len(r)) for r in reqs)
    return sum(kv.pages_to_grow(r, r.kv_allocated_len + 1) for r in reqs)


def _has_room(sched: Scheduler, reqs: list[Req]) -> bool:
    return sched.kv.ensure_free_pages(_pages_for_decode(sched, reqs))


def make_room_for_decode(sched: Scheduler, batch: ScheduleBatch) -> list[Req]:
    """Evict, resolve the forward in flight, then retract until every remaining request has
    its next slots. Returns the retracted requests (already removed from `batch`)."""
    if not _has_room(sched, batch.reqs) and sched.resolve_inflight():
        # Requests that finished in it released their KV; none has a forward in flight now,
        # so a victim's row and slots can be given back safely.
        batch.filter_finished()
    retracted: list[Req] = []
    # Victims: fewest decoded tokens first, and among those the longest prompt, so the most
    # decoded requests with the shortest prompts are retracted last.
    order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)),
                   reverse=True)
    while len(order) > 1 and not _has_room(sched, order):
        victim = order.pop()
        sched.kv.retract(victim)
        sched.stats["retracted_reqs"] += 1
        retracted.append(victim)
    if order and not _has_room(sched, order):
        alloc = sched.kv.allocator
        raise RuntimeError(
            f"KV pool of {alloc.total_slots} slots cannot hold even one running request "
            f"({order[0]}, needs {_pages_for_decode(sched, order)} more page(s) of "
            f"{sched.page_size}; {alloc.available_size()} slots free, "
            f"{sched.kv.cache.protected_size()} locked by the cache); raise kv_pool_tokens"
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
    for req in reqs:
        pos = req.kv_allocated_len
        batch.out_cache_loc.append(sched.kv.claim_decode(req))
        batch.input_ids.append(sched.next_input_token(req))
        batch.positions.append(pos)
        batch.prefix_lens.append(pos)
        batch.extend_lens.append(1)
        batch.sample_mask.append(True)
