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

from plugserve import fixes
from plugserve.hookspecs import hookimpl
from plugserve_checker.errors import KVLeakError
from plugserve_checker.physical import check_pages
from plugserve_checker.terms import (
    PoolTerms,
    batches_to_count,
    busy_terms,
    committed_lag,
    idle_terms,
    live_reqs,
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
        self.failed: KVLeakError | None = None

    # --- hooks ----------------------------------------------------------------------------
    @hookimpl
    def plugserve_engine_configured(self, config: EngineConfig, scheduler: Any) -> None:
        if self.level:
            self._idle(scheduler, phase="start")

    @hookimpl
    def plugserve_after_step(self, scheduler: Any) -> None:
        if not self.level:
            return
        if scheduler.config.spec_topk > 1 and fixes.reverted("spec_topk_busy_check_skip"):
            return  # the old behaviour: no busy check under tree drafting
        t0 = time.perf_counter()
        reqs = live_reqs(batches_to_count(scheduler))
        terms = tuple(busy_terms(pool, reqs) for pool in scheduler.accounted_pools)
        self._record(scheduler, "busy", terms)
        self._check_committed(scheduler, reqs)
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
        terms = tuple(idle_terms(pool) for pool in scheduler.accounted_pools)
        self._record(scheduler, phase, terms)
        rows = scheduler.req_to_token_pool
        held_rows = sum(pool.session_held_rows() for pool in scheduler.accounted_pools[:1])
        if rows.available_rows() + held_rows != rows.num_rows:
            self._fail(
                scheduler, phase,
                f"request rows not whole at {phase}: free {rows.available_rows()} + "
                f"session-held {held_rows} != rows {rows.num_rows}",
            )
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
                    f"{req.extra.get('pending_forwards', 0)} in flight)",
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
        parts = [
            f"{t.pool}: avail={t.available} evict={t.evictable} prot={t.protected} "
            f"sess={t.session_held} uncached={t.uncached} total={t.total}"
            for t in terms
        ]
        return f"step {step} {phase}: " + " | ".join(parts)

    def counters(self) -> dict[str, Any]:
        return {
            "mem_check_level": self.level,
            "steps_checked": self.steps_checked,
            "idle_checks": self.idle_checks,
            "check_time_s": self.check_time_s,
            "ring_entries": len(self.ring),
        }
