"""Scheduler: continuous batching with two event loops (normal and overlap).

Normal loop, one step: build the next batch, run it, process its results, call the
after-step hook. Overlap loop, one step: build batch N+1 while batch N runs on the worker
thread, then process N's results; the inputs of N+1 that N produces are *future* tokens the
runner resolves on the worker thread, which runs batches in order.

The scheduler decides *who* runs; the KV manager (`self.kv`) decides what memory that takes.
Its helpers decide one thing each and return it instead of writing scheduler state: the
prefill adder (`PrefillAdder.build` -> `PrefillDecision`), the decode manager (room, retract
victims, the decode layout) and result processing (tokens emitted, requests finished). The
scheduler applies their decisions; a request is finished in one place, `finish_req`.
"""

from __future__ import annotations

import collections
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from plugserve.config import EngineConfig
from plugserve.fixes import FixToggle
from plugserve.mem.accounting import PoolTerms
from plugserve.mem.manager import KVManager
from plugserve.sched.decode import DecodeManager
from plugserve.sched.grammar_wait import split_waiting, wait_for_compiles
from plugserve.sched.prefill import PrefillAdder, PrefillDecision
from plugserve.sched.results import StopRules, process_result
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req
from plugserve.structs.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from plugserve.runner.model_runner import ModelRunner
    from plugserve.spec.base import SpecAlgorithm
    from plugserve.structs.step import PreparedStep, StepOutput

BATCH_IDENTITY = FixToggle(
    "batch_identity", "count the running batch by ==, not by identity, next to the last batch"
)


class SchedulerStuckError(RuntimeError):
    """Requests wait but none can ever be admitted: memory was lost (a leaked lock?)."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv: KVManager,
        hook: Any,
        eos_token_ids: frozenset[int],
        decode_text: Any,
        spec: SpecAlgorithm | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv = kv
        self.hook = hook
        self.page_size = config.page_size
        self.stop_rules = StopRules(eos_token_ids, int(runner.context_len), decode_text)
        self.prefill_adder = PrefillAdder(config, kv)
        self.decode = DecodeManager(kv, config.page_size)
        self.waiting: deque[Req] = deque()
        self.running_batch = ScheduleBatch.empty()
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.overlap = config.overlap
        self._worker = ThreadPoolExecutor(1, "plugserve-forward") if self.overlap else None
        self._inflight: tuple[ScheduleBatch, PreparedStep, Future[StepOutput]] | None = None
        self._resolved_early: ScheduleBatch | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self.step_time_s: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.spec = spec
        self._count_batches_by_equality = BATCH_IDENTITY in config.revert_fixes
        self._steps_without_progress = 0

    # --- requests -------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: int) -> bool:
        """End a request now; its KV is freed exactly like a finish (once no forward that
        writes it is in flight)."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = "abort"
                req.finished_s = time.perf_counter()
                self.kv.forget_waiting(req)
                return True
        for req in self._live_reqs():
            if req.rid == rid and not req.finished():
                self.finish_req(req, "abort", time.perf_counter())
                return True
        return False

    def _live_reqs(self) -> list[Req]:
        reqs = list(self.running_batch.reqs)
        if self.last_batch is not None:
            reqs += [r for r in self.last_batch.reqs if r not in reqs]
        if self._inflight is not None:
            reqs += [r for r in self._inflight[0].reqs if r not in reqs]
        if self.chunked_req is not None and self.chunked_req not in reqs:
            reqs.append(self.chunked_req)
        return reqs

    def next_input_token(self, req: Req) -> int:
        """The token a decode feeds: the last output, or a future reference to it (overlap)."""
        return -(req.future_ref + 1) if req.future_ref is not None else req.output_ids[-1]

    def is_idle(self) -> bool:
        return (
            not self.waiting
            and self.running_batch.is_empty()
            and self.chunked_req is None
            and self._inflight is None
        )

    # --- what the checker counts ----------------------------------------------------------
    def counted_batches(self) -> list[ScheduleBatch]:
        """The last batch, and the running batch when it is a *different object* and
        non-empty (a mixed batch took the decodes over: nothing is counted twice)."""
        last, running = self.last_batch, self.running_batch
        out = [last] if last is not None else []
        if running.is_empty():
            return out
        if self._count_batches_by_equality:
            separate = last is None or _fields_differ(running, last)
        else:
            separate = running is not last
        if separate:
            out.append(running)
        return out

    def counted_reqs(self) -> list[Req]:
        """Requests that own KV right now: those of the counted batches that still hold a
        row, and a chunked prefill whose next chunk waits for memory (in no batch)."""
        reqs = [r for b in self.counted_batches() for r in b.reqs if r.req_pool_idx is not None]
        chunked = self.chunked_req
        if chunked is not None and chunked.req_pool_idx is not None and all(
            r is not chunked for r in reqs
        ):
            reqs.append(chunked)
        return reqs

    def kv_terms(self) -> tuple[PoolTerms, ...]:
        """Each pool's conservation terms after this step."""
        return self.kv.terms(self.counted_reqs())

    # --- building batches -----------------------------------------------------------------
    def _fold_last_batch(self) -> None:
        """Move the requests of the last extend batch into the running (decode) batch."""
        last = self.last_batch
        if last is None or last.mode is not ForwardMode.EXTEND or last is self.running_batch:
            return
        keep = [
            r for r in last.reqs
            if not r.finished() and not r.is_retracted and r is not self.chunked_req
        ]
        # A finished prefill's page-aligned prompt is shared from now on, not at the
        # request's end: later requests with the same prefix reuse it while it decodes.
        prefills = last.reqs[: len(last.reqs) - last.num_decode_reqs]
        for req in prefills:
            if req in keep and req.req_pool_idx is not None:
                self.kv.cache_unfinished(req)
        self.running_batch.filter_finished()
        if self.running_batch.is_empty():
            self.running_batch = ScheduleBatch.empty()
        self.running_batch.reqs.extend(keep)

    def get_next_batch(self) -> ScheduleBatch | None:
        self._fold_last_batch()
        if self.chunked_req is not None:
            self.kv.cache_unfinished(self.chunked_req)
        # Sliding-window KV that no forward reads any more goes back to the SWA pool.
        self.kv.evict_out_of_window(
            [*self.running_batch.reqs, *([self.chunked_req] if self.chunked_req else [])])
        prefill = self._apply(self.prefill_adder.build(
            self._admissible(), self.chunked_req, len(self.running_batch.reqs), self.has_inflight))
        self.running_batch.filter_finished()
        if prefill is not None:
            if self.config.enable_mixed_chunk and not self.running_batch.is_empty():
                self._mix_decodes_into(prefill)
            return prefill
        if self.running_batch.is_empty():
            return None
        self._make_room_for_decode(self.running_batch)
        if self.running_batch.is_empty():
            return None
        self.decode.prepare(self.running_batch, self.next_input_token)
        return self.running_batch

    def _admissible(self) -> list[Req]:
        """The waiting requests that may be admitted: not those whose grammar is compiling;
        those whose grammar failed to compile end here with the compiler's message."""
        ready, failed = split_waiting(self.waiting)
        for req in failed:
            self.waiting.remove(req)
            self.kv.forget_waiting(req)
            req.finished_reason = "error"
            req.finished_s = time.perf_counter()
        return ready

    def _apply(self, decision: PrefillDecision) -> ScheduleBatch | None:
        """Carry out the prefill adder's decision on the queue and the chunked request."""
        if decision.admitted:
            taken = set(map(id, decision.admitted))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        self.chunked_req = decision.chunked_req
        if decision.requeued is not None:
            self._requeue([decision.requeued])
        self.stats["prefill_tokens"] += decision.prefill_tokens
        return decision.batch

    def _mix_decodes_into(self, prefill: ScheduleBatch) -> None:
        decode = self.running_batch
        self._make_room_for_decode(decode)
        self.decode.append(prefill, decode.reqs, self.next_input_token)
        prefill.reqs.extend(decode.reqs)
        prefill.num_decode_reqs = len(decode.reqs)
        prefill.refresh_rows()
        # The decode requests moved into the mixed batch; nothing is counted twice.
        self.running_batch = ScheduleBatch.empty()

    def _make_room_for_decode(self, batch: ScheduleBatch) -> None:
        """Every request of `batch` gets its next slots: the cache is evicted first; when that
        is not enough, the forward in flight is resolved (requests that finished in it give
        their memory back only then); then the decode manager retracts victims."""
        if self.kv.can_decode(batch.reqs):
            return  # the room is made (the common step): nothing to resolve or retract
        if self.resolve_inflight():
            batch.filter_finished()
        retracted, failed = self.decode.retract_until_room(batch)
        self._requeue(retracted)
        if failed is not None:
            self.finish_req(failed, "error", time.perf_counter())

    def _requeue(self, retracted: list[Req]) -> None:
        """Retracted requests go back to the front of the queue, in order."""
        self.stats["retracted_reqs"] += len(retracted)
        for req in reversed(retracted):
            self.waiting.appendleft(req)

    @property
    def has_inflight(self) -> bool:
        return self._inflight is not None

    def resolve_inflight(self) -> bool:
        """Overlap loop: wait for the forward in flight and process its results now (memory
        that finished requests hold is released only then). False if none was in flight."""
        if self._inflight is None:
            return False
        batch, step, future = self._inflight
        self._inflight = None
        self._process(step, future)
        self._resolved_early = batch
        return True

    # --- results --------------------------------------------------------------------------
    def finish_req(self, req: Req, reason: str, now: float) -> None:
        """The one place a request ends (finished, aborted, failed): no further chunk or
        decode is scheduled for it, and the KV manager settles and releases its KV."""
        req.finished_reason = reason
        req.finished_s = now
        if req is self.chunked_req:
            self.chunked_req = None  # no further chunk may run for it
        self.kv.finish(req)

    # --- loops ----------------------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch) -> tuple[PreparedStep, Future[StepOutput] | StepOutput]:
        refs = self.runner.assign_future_refs(batch)
        for req, ref, sampled in zip(batch.reqs, refs, batch.sample_mask, strict=True):
            req.pending_forwards += 1
            if sampled and self.overlap and self.spec is None:
                req.future_ref = ref
        step = self.runner.prepare(batch, refs)
        if self._worker is not None:
            return step, self._worker.submit(self.runner.run, step)
        return step, self.runner.run(step)

    def _process(self, step: PreparedStep, out: StepOutput | Future[StepOutput]) -> None:
        if isinstance(out, Future):
            t0 = time.perf_counter()
            out = out.result()
            self.step_time_s["wait"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        now = time.perf_counter()
        for req, reason in process_result(self.kv, self.stop_rules, step, out):
            self.finish_req(req, reason, now)
        self.step_time_s["post_process"] += time.perf_counter() - t1

    def step(self) -> bool:
        """One scheduler step. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        self._resolved_early = None
        batch = self.get_next_batch()  # may resolve the in-flight batch early (overlap)
        t1 = time.perf_counter()
        self.step_time_s["schedule"] += t1 - t0
        previous = self._inflight
        self._inflight = None
        if batch is not None:
            step, out = self._launch(batch)
            if isinstance(out, Future):
                self._inflight = (batch, step, out)
            else:
                self.step_time_s["run"] += time.perf_counter() - t1
                self._process(step, out)
        if previous is not None:
            self._process(previous[1], previous[2])
        done = batch or (previous[0] if previous is not None else self._resolved_early)
        if done is None:
            self._check_progress()
            return False
        self._steps_without_progress = 0
        self.last_batch = done
        self.stats["steps"] += 1
        t4 = time.perf_counter()
        self.hook.plugserve_after_step(scheduler=self)
        self.step_time_s["check"] += time.perf_counter() - t4
        return True

    def _check_progress(self) -> None:
        """Nothing ran although requests wait: one retry (a chunk retracted for memory is
        re-admitted next step), then a clear error instead of spinning forever."""
        if not self.waiting or not self.running_batch.is_empty():
            return
        if wait_for_compiles(self.waiting):  # waiting for a grammar, not stuck
            self._steps_without_progress = 0
            return
        self._steps_without_progress += 1
        if self._steps_without_progress < 2:
            return
        why = self.kv.idle_sessions_in_the_way()
        if why is not None:
            # Idle streaming sessions keep their KV: the request cannot run until some close.
            # It fails alone; the engine keeps serving.
            req = self.waiting.popleft()
            self.kv.forget_waiting(req)
            req.error = why
            self.finish_req(req, "error", time.perf_counter())
            self._steps_without_progress = 0
            return
        raise SchedulerStuckError(
            f"the scheduler cannot make progress: {len(self.waiting)} request(s) wait and none "
            f"runs, but the first ({self.waiting[0]}) cannot be admitted: {self.kv.capacity()}; "
            "slots locked while no request runs mean a cache lock was never released"
        )

    def run_until_idle(self, on_step: Any = None) -> None:
        while True:
            progressed = self.step()
            if on_step is not None:
                on_step()
            if not progressed and self.is_idle():
                self.settle_idle()
                return

    def settle_idle(self) -> None:
        """Nothing waits, runs or is in flight: drop the spent batches, run the idle hook."""
        self.running_batch = ScheduleBatch.empty()
        self.last_batch = None
        self.hook.plugserve_scheduler_idle(scheduler=self)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _fields_differ(a: ScheduleBatch, b: ScheduleBatch) -> bool:
    """The old, wrong comparison (fix toggle `batch_identity`): field by field, as a plain
    dataclass `==` did; comparing tensors this way raises or misjudges."""
    return tuple(getattr(a, f.name) for f in fields(a)) != tuple(
        getattr(b, f.name) for f in fields(b)
    )
