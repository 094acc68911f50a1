"""KVConservationChecker: after every busy step and at idle, prove every KV slot is free,
cached, held by a session or owned by a running request (DESIGN.md §3).

Levels (`PLUGSERVE_MEM_CHECK`): 0 off; 1 quiet — each step's terms go into a bounded ring
buffer, dumped only when a leak is found; 2 verbose — every step is also logged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from plugserve.hookspecs import hookimpl
from plugserve.mem.accounting import PoolTerms
from plugserve_checker.errors import KVAccountingError, KVLeakError
from plugserve_checker.physical import check_pages
from plugserve_checker.plugin import SPEC_TOPK_BUSY_CHECK_SKIP
from plugserve_checker.terms import (
    committed_lag,
    freed_flags_disagree,
    protected_misaligned,
)

if TYPE_CHECKING:
    from plugserve.config import EngineConfig

log = logging.getLogger("plugserve.checker")


class KVConservationChecker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.level = config.mem_check
        self.physical = config.check_pages
        # (step number, phase, terms of each pool): formatted only when dumped.
        self.ring: deque[tuple[int, str, tuple[PoolTerms, ...]]] = deque(
            maxlen=config.mem_check_ring_size
        )
        self.steps_checked = 0
        self.idle_checks = 0
        self.check_time_s = 0.0
        self.failed: KVAccountingError | None = None
        # The old behaviour of fix toggle spec_topk_busy_check_skip: no busy check under
        # tree drafting.
        self.skip_busy = (config.spec_topk > 1
                          and SPEC_TOPK_BUSY_CHECK_SKIP in config.revert_fixes)

    # --- hooks ----------------------------------------------------------------------------
    @hookimpl
    def plugserve_engine_configured(self, config: EngineConfig, scheduler: Any) -> None:
        if self.level:
            self._idle(scheduler, phase="start")

    @hookimpl
    def plugserve_after_step(self, scheduler: Any) -> None:
        if not self.level or self.skip_busy:
            return
        t0 = time.perf_counter()
        reqs = scheduler.counted_reqs()
        # Before the law: a misaligned protected prefix also unbalances it; name the cause.
        self._check_protected_aligned(scheduler, reqs)
        self._record(scheduler, "busy", scheduler.kv_terms())
        self._check_committed(scheduler, reqs)
        self._check_freed_flags(scheduler)
        if self.physical:
            check_pages(scheduler, reqs)
        self.steps_checked += 1
        self.check_time_s += time.perf_counter() - t0

    @hookimpl
    def plugserve_scheduler_idle(self, scheduler: Any) -> None:
        if self.level:
            self._idle(scheduler, phase="idle")

    # --- checks ---------------------------------------------------------------------------
    def _idle(self, scheduler: Any, phase: str) -> None:
        t0 = time.perf_counter()
        kv = scheduler.kv
        terms = kv.terms([])
        self._record(scheduler, phase, terms)
        # Only open session slots may keep cache locks at idle (their first turn's prefix),
        # in every pool.
        for t in terms:
            session_locked = kv.session_locked_slots(t.pool)
            if t.protected != session_locked:
                self._fail(scheduler, phase,
                           f"pool {t.pool!r}: {t.protected} slots still locked by the cache at "
                           f"{phase} with no request running, {session_locked} of them by open "
                           "sessions (a lock was never released)")
        rows_problem = kv.rows_problem()
        if rows_problem is not None:
            self._fail(scheduler, phase, f"{rows_problem} at {phase}")
        if self.physical:
            check_pages(scheduler, [])
        self.idle_checks += 1
        self.check_time_s += time.perf_counter() - t0

    def _check_committed(self, scheduler: Any, reqs: list[Any]) -> None:
        for req in reqs:
            lag = committed_lag(req)
            if lag:
                self._fail(
                    scheduler, "busy",
                    f"request {req.rid}: committed {req.kv_committed_len} is off by {lag:+d} "
                    f"from its {req.seq_len} tokens (every token but the last has KV, the last "
                    f"one's is claimed by the forward in flight: "
                    f"{req.pending_forwards} in flight)",
                )

    def _check_protected_aligned(self, scheduler: Any, reqs: list[Any]) -> None:
        page = self.config.page_size
        for req in reqs:
            if protected_misaligned(req, page):
                self._fail(
                    scheduler, "busy",
                    f"request {req.rid}: cache_protected_len {req.cache_protected_len} is not a "
                    f"multiple of page_size {page}; the prefix cache must match and lock whole "
                    "pages only",
                )

    def _check_freed_flags(self, scheduler: Any) -> None:
        for batch in scheduler.counted_batches():
            for req in batch.reqs:
                if freed_flags_disagree(req):
                    self._fail(
                        scheduler, "busy",
                        f"request {req.rid}: committed KV freed={req.kv_committed_freed} but "
                        f"over-allocation freed={req.kv_overallocated_freed}; a release "
                        "frees both halves",
                    )

    def _record(self, scheduler: Any, phase: str, terms: tuple[PoolTerms, ...]) -> None:
        step = int(scheduler.stats["steps"])
        self.ring.append((step, phase, terms))
        if self.level >= 2:
            log.info(self._line(step, phase, terms))
        bad = [t for t in terms if t.balance != 0]
        if bad:
            self._fail(scheduler, phase, "; ".join(t.describe() for t in bad))

    def _fail(self, scheduler: Any, phase: str, what: str) -> None:
        step = int(scheduler.stats["steps"])
        history = "\n".join(self._line(*entry) for entry in self.ring)
        self.failed = KVLeakError(
            f"KV accounting broken after step {step} ({phase}): {what}\n"
            f"last {len(self.ring)} checks (oldest first):\n{history}"
        )
        raise self.failed

    @staticmethod
    def _line(step: int, phase: str, terms: tuple[PoolTerms, ...]) -> str:
        return f"step {step} {phase}: " + " | ".join(t.line() for t in terms)

    def counters(self) -> dict[str, Any]:
        return {
            "mem_check_level": self.level,
            "steps_checked": self.steps_checked,
            "idle_checks": self.idle_checks,
            "check_time_s": self.check_time_s,
            "ring_entries": len(self.ring),
        }
