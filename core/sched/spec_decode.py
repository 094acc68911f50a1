"""KV accounting of speculative decode rounds (DESIGN.md §5).

Before each round the scheduler keeps `2 * alloc_len` slots allocated past the committed
length (the reserve; a round touches at most `alloc_len` from where it starts, and under the
overlap loop it starts up to one round later than the scheduler knows). An always-on check
refuses a round whose reserve would not fit the request's `req_to_token` row.

Committed length: under the normal loop a round adds its accept length when it resolves.
Under the overlap loop the round's first slot (the verified last token's KV, certain to be
written) is pre-claimed when the round is prepared (committed += 1) and resolve adds
`accept_len - 1`; when a request finishes, the pre-claims of rounds still in flight for it
are undone, so its committed length is what its resolved rounds wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve import fixes
from plugserve.runner.forward_batch import ForwardMode
from plugserve.sched.batch import ScheduleBatch
from plugserve.sched.req import Req
from plugserve.spec.alloc import reserve_len

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler

PRECLAIMS = "spec_preclaims"  # req.extra: pre-claimed rounds not yet resolved


def preclaims_bonus(sched: Scheduler) -> bool:
    return sched.overlap and not fixes.reverted("spec_v2_bonus_preclaim")


def target_allocated_len(sched: Scheduler, req: Req) -> int:
    """The allocated length a request needs before its next round is launched."""
    committed = req.kv_committed_len + (1 if preclaims_bonus(sched) else 0)
    return max(req.kv_allocated_len, committed + reserve_len(sched.config))


def check_row_width(sched: Scheduler, req: Req, needed: int) -> None:
    width = sched.req_to_token_pool.row_width
    if needed > width:
        raise RuntimeError(
            f"request {req.rid}: the next speculative round needs allocated length {needed} "
            f"but its req_to_token row is only {width} slots wide (committed "
            f"{req.kv_committed_len}, reserve {reserve_len(sched.config)}); the spec plugin must "
            "widen the rows through plugserve_extra_row_width"
        )


def prepare_spec_decode(sched: Scheduler, batch: ScheduleBatch) -> None:
    """Top up every request's reserve, pre-claim under overlap, lay out the batch."""
    from plugserve.sched.prefill import _last_slot

    batch.mode = ForwardMode.DECODE
    batch.input_ids, batch.positions, batch.out_cache_loc = [], [], []
    batch.prefix_lens, batch.extend_lens, batch.sample_mask = [], [], []
    preclaim = preclaims_bonus(sched)
    for req in batch.reqs:
        assert req.req_pool_idx is not None
        needed = target_allocated_len(sched, req)
        check_row_width(sched, req, needed)
        old = req.kv_allocated_len
        if needed > old:
            slots = sched.allocator.extend_slots(_last_slot(sched, req), old, needed)
            assert slots is not None, "make_room_for_decode guarantees the reserve"
            sched.req_to_token_pool.write(req.req_pool_idx, old, slots)
            req.kv_allocated_len = needed
        if preclaim:
            req.kv_committed_len += 1
            req.extra[PRECLAIMS] = req.extra.get(PRECLAIMS, 0) + 1
        batch.input_ids.append(0)  # the round reads its own state, not this token
        batch.positions.append(req.kv_committed_len)
        batch.prefix_lens.append(req.kv_committed_len)
        batch.extend_lens.append(1)
        batch.sample_mask.append(True)
    batch.refresh_rows()


def resolve_committed(sched: Scheduler, req: Req, accept_len: int) -> None:
    """A round of a live request resolved with `accept_len` emitted tokens."""
    if req.extra.get(PRECLAIMS, 0) > 0:
        req.extra[PRECLAIMS] -= 1
        req.kv_committed_len += accept_len - 1
    else:
        req.kv_committed_len += accept_len


def settle_finished(req: Req) -> None:
    """A request finished: drop the pre-claims of rounds still in flight for it, and keep
    committed within its (possibly stop-truncated) tokens."""
    pending = req.extra.pop(PRECLAIMS, 0)
    req.kv_committed_len -= pending
    req.kv_committed_len = min(req.kv_committed_len, req.seq_len)


def forget_round(req: Req) -> None:
    """A round of a finished or retracted request resolved: its pre-claim (if any) is gone."""
    if req.extra.get(PRECLAIMS, 0) > 0:
        req.extra[PRECLAIMS] -= 1
