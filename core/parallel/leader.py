"""Rank 0's scheduler: the same `Scheduler` as every rank's, announcing each call first.

Every rank runs an identical scheduler and KV manager on the same requests (SGLang's way, see
docs/architecture.md), so every rank makes the same decisions on the same slot indices. Rank 0
is the one that takes requests: before each `step`, `settle_idle` and `close` it sends the
followers what changed since the last call (`CommandChannel`) and which call follows. Aborts
and prefix-cache flushes are recorded here; the engine records queued requests and session
changes (`TensorParallel.record`).

A step that fails here ends the other ranks and raises the error (naming the rank that went
away when a collective failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from plugserve.parallel.channel import CLOSE, IDLE, STEP
from plugserve.parallel.launch import TensorParallelError
from plugserve.parallel.runtime import TensorParallel
from plugserve.sched.scheduler import Scheduler


class LeaderScheduler(Scheduler):
    def __init__(self, *args: Any, tp: TensorParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp
        # Flushing the prefix cache (idle, e.g. before a benchmark's timed run) frees KV
        # outside a step: every rank flushes.
        reset = self.kv.cache.reset

        def reset_on_every_rank() -> None:
            tp.record(("reset_cache",))
            reset()

        self.kv.cache.reset = reset_on_every_rank

    def abort(self, rid: int) -> bool:
        self.tp.record(("abort", rid))
        return super().abort(rid)

    def step(self) -> bool:
        with self._announced(STEP):
            return super().step()

    def settle_idle(self) -> None:
        with self._announced(IDLE):
            super().settle_idle()

    def close(self) -> None:
        super().close()
        if not self.tp.closed and self.tp.problem() is None:
            try:
                self.tp.channel.send(CLOSE)
            except RuntimeError:
                pass  # a rank is gone: TensorParallel.close ends the others

    @contextmanager
    def _announced(self, op: int) -> Iterator[None]:
        problem = self.tp.problem()
        if problem is not None:
            raise self.tp.fail(TensorParallelError(problem))
        try:
            self.tp.channel.send(op)
            yield
        except BaseException as exc:
            failure = self.tp.fail(exc)
            if failure is exc:
                raise
            raise failure from exc
