"""Laying out a speculative decode batch. The KV accounting of a round (reserve, pre-claim,
resolve) is `plugserve.mem.spec_accounting`; the round itself runs in the spec algorithm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from plugserve.sched.scheduler import Scheduler


def prepare_spec_decode(sched: Scheduler, batch: ScheduleBatch) -> None:
    """Top up every request's reserve, pre-claim under overlap, lay out the batch."""
    spec_kv = sched.spec_kv
    assert spec_kv is not None
    batch.mode = ForwardMode.DECODE
    batch.input_ids, batch.positions, batch.out_cache_loc = [], [], []
    batch.prefix_lens, batch.extend_lens, batch.sample_mask = [], [], []
    for req in batch.reqs:
        spec_kv.prepare_round(req)
        batch.input_ids.append(0)  # the round reads its own state, not this token
        batch.positions.append(req.kv_committed_len)
        batch.prefix_lens.append(req.kv_committed_len)
        batch.extend_lens.append(1)
        batch.sample_mask.append(True)
    batch.refresh_rows()
