"""The cross-rank check: every rank's KV accounting must be rank 0's, step by step.

Identical schedulers fed the same requests must keep identical books: the same terms of the
conservation law for every pool (available, evictable, protected, session_held, uncached,
total), after the same number of steps. After every busy step, at idle and at start-up each
rank puts its terms in one small int64 tensor and all-gathers it on the check group; every
rank compares them, so every rank stops at the step where one diverged, and the error names
the rank, the pool and the terms. It runs before the checker plugin's own law (`tryfirst`),
so a rank whose books drift apart is named as the rank that differs, not only as a leak.

On when the invariant checker is (mem_check >= 1).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plugserve.fixes import FixToggle
from plugserve.hookspecs import hookimpl
from plugserve.mem.accounting import PoolTerms
from plugserve.model.tp_shard import CollectiveError

if TYPE_CHECKING:
    from plugserve.parallel.runtime import TensorParallel

TP_RANK1_SKIPS_FREE = FixToggle(
    "tp_rank1_skips_free",
    "rank 1 of a tensor-parallel engine skips one free of KV pages, so its accounting "
    "drifts from rank 0's (the cross-rank check must catch it at that step)",
)
_FIELDS = ("available", "evictable", "protected", "session_held", "uncached", "total")


class CrossRankMismatchError(RuntimeError):
    """Two ranks' KV accounting differs; the message names the rank, the pool and the terms."""


class CrossRankCheck:
    """A lifecycle observer (registered with the engine's checkers) on every rank."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.checks = 0
        self.check_time_s = 0.0

    @hookimpl(tryfirst=True)
    def plugserve_engine_configured(self, config: Any, scheduler: Any) -> None:
        self.compare(scheduler, "start", scheduler.kv.terms([]))

    @hookimpl(tryfirst=True)
    def plugserve_after_step(self, scheduler: Any) -> None:
        self.compare(scheduler, "busy", scheduler.kv_terms())

    @hookimpl(tryfirst=True)
    def plugserve_scheduler_idle(self, scheduler: Any) -> None:
        self.compare(scheduler, "idle", scheduler.kv.terms([]))

    def compare(self, scheduler: Any, phase: str, terms: tuple[PoolTerms, ...]) -> None:
        t0 = time.perf_counter()
        step = int(scheduler.stats["steps"])
        mine = torch.tensor([step, *(getattr(t, f) for t in terms for f in _FIELDS)],
                            dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.tp.world_size)]
        try:
            dist.all_gather(rows, mine, group=self.tp.check_group)
        except RuntimeError as exc:
            raise CollectiveError(f"the cross-rank KV check after step {step} ({phase}) failed "
                                  f"on rank {self.tp.rank}: {str(exc).splitlines()[0]}") from exc
        self.checks += 1
        self.check_time_s += time.perf_counter() - t0
        problem = mismatch(rows, [t.pool for t in terms], phase)
        if problem is not None:
            raise CrossRankMismatchError(problem)


def mismatch(rows: list[torch.Tensor], pools: list[str], phase: str) -> str | None:
    """The first rank whose [step, terms...] differs from rank 0's, described (None: equal)."""
    first = rows[0].tolist()
    for rank, row in enumerate(rows[1:], start=1):
        values = row.tolist()
        if values == first:
            continue
        if values[0] != first[0]:
            return (f"tensor-parallel rank {rank} is at step {values[0]} but rank 0 at step "
                    f"{first[0]} ({phase}): the ranks' schedules diverged")
        parts = []
        for i, pool in enumerate(pools):
            lo = 1 + i * len(_FIELDS)
            ours, theirs = first[lo : lo + len(_FIELDS)], values[lo : lo + len(_FIELDS)]
            if ours != theirs:
                terms = ", ".join(f"{f} {b} (rank 0: {a})" for f, a, b
                                  in zip(_FIELDS, ours, theirs, strict=True) if a != b)
                parts.append(f"pool {pool!r}: {terms}; rank {rank}: "
                             + " ".join(f"{f}={b}" for f, b in zip(_FIELDS, theirs, strict=True))
                             + "; rank 0: "
                             + " ".join(f"{f}={a}" for f, a in zip(_FIELDS, ours, strict=True)))
        return (f"KV accounting of tensor-parallel rank {rank} differs from rank 0's after "
                f"step {first[0]} ({phase}): " + "; ".join(parts))
    return None


def skip_one_free(allocator: Any) -> None:
    """Fix toggle tp_rank1_skips_free (rank 1 only): the first free of pages after start-up
    is not made, so this rank's books differ from the others'."""
    free_slots = allocator.free_slots
    skipped = False

    def free_slots_skipping_once(slots: Any) -> None:
        nonlocal skipped
        empty = slots.numel() == 0 if isinstance(slots, torch.Tensor) else not slots
        if not skipped and not empty:
            skipped = True
            return
        free_slots(slots)

    allocator.free_slots = free_slots_skipping_once
