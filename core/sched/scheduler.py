"""Scheduler: continuous batching with two event loops (normal and overlap).

Normal loop, one step: build the next batch, run it, process its results, call the
after-step hook. Overlap loop, one step: build batch N+1 while batch N runs on the worker
thread, then process N's results; the inputs of N+1 that N produces are *future* tokens the
runner resolves on the worker thread, which runs batches in order.
"""

from __future__ import annotations

import collections
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from plugserve.cache.base import PrefixCache
from plugserve.config import EngineConfig
from plugserve.mem.accounting import AccountedPool
from plugserve.mem.allocator import PagedAllocator
from plugserve.mem.req_to_token import ReqToTokenPool
from plugserve.runner.forward_batch import ForwardMode
from plugserve.sched.batch import ScheduleBatch
from plugserve.sched.decode import append_decode, make_room_for_decode, prepare_decode
from plugserve.sched.prefill import build_prefill_batch
from plugserve.sched.req import Req
from plugserve.sched.spec_decode import (
    forget_round,
    prepare_spec_decode,
    resolve_committed,
    settle_finished,
)
from plugserve.sched.stop import check_stop

if TYPE_CHECKING:
    from plugserve.runner.model_runner import ModelRunner, PreparedStep, StepOutput
    from plugserve.spec.base import SpecAlgorithm


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        req_to_token_pool: ReqToTokenPool,
        allocator: PagedAllocator,
        tree_cache: PrefixCache,
        hook: Any,
        eos_token_ids: frozenset[int],
        decode_text: Any,
    ) -> None:
        self.config = config
        self.runner = runner
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.hook = hook
        self.page_size = config.page_size
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text
        self.waiting: deque[Req] = deque()
        self.running_batch = ScheduleBatch.empty()
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.overlap = config.overlap
        self._worker = ThreadPoolExecutor(1, "plugserve-forward") if self.overlap else None
        self._inflight: tuple[ScheduleBatch, PreparedStep, Future[StepOutput]] | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self.step_time_s: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.finished_reqs: list[Req] = []  # filled each step, drained by the engine
        self.kv_pools: list[Any] = []  # every KV pool, for checkers
        self.accounted_pools: list[AccountedPool] = []  # set by the engine
        self.spec: SpecAlgorithm | None = None  # set by the engine when speculation is on

    # --- requests -------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: int) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = "abort"
                self.finished_reqs.append(req)
                return True
        for req in self._live_reqs():
            if req.rid == rid and not req.finished():
                req.finished_reason = "abort"
                if self.spec is not None:
                    settle_finished(req)
                self._maybe_release(req)
                self.finished_reqs.append(req)
                return True
        return False

    def _live_reqs(self) -> list[Req]:
        reqs = list(self.running_batch.reqs)
        if self.last_batch is not None:
            reqs += [r for r in self.last_batch.reqs if r not in reqs]
        if self.chunked_req is not None and self.chunked_req not in reqs:
            reqs.append(self.chunked_req)
        return reqs

    def next_input_token(self, req: Req) -> int:
        """The token a decode feeds: the last output, or a future reference to it (overlap)."""
        ref = req.extra.get("future_ref")
        return -(ref + 1) if ref is not None else req.output_ids[-1]

    def is_idle(self) -> bool:
        return (
            not self.waiting
            and self.running_batch.is_empty()
            and self.chunked_req is None
            and self._inflight is None
        )

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
                self.tree_cache.cache_unfinished_req(req)
        self.running_batch.filter_finished()
        if self.running_batch.is_empty():
            self.running_batch = ScheduleBatch.empty()
        self.running_batch.reqs.extend(keep)

    def get_next_batch(self) -> ScheduleBatch | None:
        self._fold_last_batch()
        if self.chunked_req is not None:
            self.tree_cache.cache_unfinished_req(self.chunked_req)
        prefill = build_prefill_batch(self)
        self.running_batch.filter_finished()
        if prefill is not None:
            if self.config.enable_mixed_chunk and not self.running_batch.is_empty():
                self._mix_decodes_into(prefill)
            return prefill
        if self.running_batch.is_empty():
            return None
        retracted = make_room_for_decode(self, self.running_batch)
        self._requeue(retracted)
        if self.spec is not None:
            prepare_spec_decode(self, self.running_batch)
        else:
            prepare_decode(self, self.running_batch)
        return self.running_batch

    def _mix_decodes_into(self, prefill: ScheduleBatch) -> None:
        decode = self.running_batch
        self._requeue(make_room_for_decode(self, decode))
        append_decode(self, prefill, decode.reqs)
        prefill.reqs.extend(decode.reqs)
        prefill.num_decode_reqs = len(decode.reqs)
        prefill.refresh_rows()
        # The decode requests moved into the mixed batch; nothing is counted twice.
        self.running_batch = ScheduleBatch.empty()

    def _requeue(self, retracted: list[Req]) -> None:
        for req in reversed(retracted):
            self.waiting.appendleft(req)

    # --- results --------------------------------------------------------------------------
    def _maybe_release(self, req: Req) -> None:
        """Release a finished request's KV once no forward that writes it is in flight."""
        if req.finish_released or req.extra.get("pending_forwards", 0) > 0:
            return
        if req.req_pool_idx is None:
            req.finish_released = True
            return
        if req is self.chunked_req:
            self.chunked_req = None
        self.tree_cache.cache_finished_req(req)

    def _finish(self, req: Req, reason: str, now: float) -> None:
        req.finished_reason = reason
        req.finished_s = now
        if self.spec is not None:
            settle_finished(req)
        self.finished_reqs.append(req)
        self._maybe_release(req)

    def _emit(self, req: Req, token: int, logprob: float | None, now: float) -> bool:
        """Append one output token; True when it finished the request."""
        req.output_ids.append(token)
        if logprob is not None and req.sampling.logprobs:
            req.output_logprobs.append(logprob)
        if req.first_token_s is None:
            req.first_token_s = now
        req.token_times_s.append(now)
        reason = check_stop(req, self.eos_token_ids, self.config_context_len, self.decode_text)
        if reason is None:
            return False
        self._finish(req, reason, now)
        return True

    def _process_spec_result(self, step: PreparedStep, out: StepOutput) -> None:
        """Resolve a speculative round: emit each request's tokens, advance committed."""
        now = time.perf_counter()
        assert out.spec_tokens is not None
        for i, req in enumerate(step.reqs):
            req.extra["pending_forwards"] = req.extra.get("pending_forwards", 1) - 1
            if req.finished() or req.is_retracted:
                forget_round(req)
                if req.finished():
                    self._maybe_release(req)
                continue
            tokens = out.spec_tokens[i]
            logprobs = out.spec_logprobs[i] if out.spec_logprobs is not None else None
            resolve_committed(self, req, len(tokens))
            req.spec_verify_steps += 1
            req.spec_accepted_tokens += len(tokens) - 1
            req.spec_accept_hist[len(tokens)] = req.spec_accept_hist.get(len(tokens), 0) + 1
            for j, token in enumerate(tokens):
                if self._emit(req, token, logprobs[j] if logprobs else None, now):
                    break

    def process_result(self, step: PreparedStep, out: StepOutput) -> None:
        if out.spec_tokens is not None:
            self._process_spec_result(step, out)
            return
        now = time.perf_counter()
        for i, req in enumerate(step.reqs):
            req.extra["pending_forwards"] = req.extra.get("pending_forwards", 1) - 1
            if req.extra.get("future_ref") == out.future_refs[i]:
                req.extra["future_ref"] = None
            if req.finished():  # finished (or aborted) while this forward was in flight
                self._maybe_release(req)
                continue
            if req.is_retracted or not step.sample_mask[i]:
                continue
            self._emit(req, out.next_token_ids[i],
                       out.logprobs[i] if out.logprobs is not None else None, now)

    @property
    def config_context_len(self) -> int:
        return int(self.runner.context_len)

    # --- loops ----------------------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch) -> tuple[PreparedStep, Future[StepOutput] | StepOutput]:
        refs = self.runner.assign_future_refs(batch)
        for req, ref, sampled in zip(batch.reqs, refs, batch.sample_mask, strict=True):
            req.extra["pending_forwards"] = req.extra.get("pending_forwards", 0) + 1
            if sampled and self.overlap and self.spec is None:
                req.extra["future_ref"] = ref
        step = self.runner.prepare(batch, refs)
        if self._worker is not None:
            return step, self._worker.submit(self.runner.run, step)
        return step, self.runner.run(step)

    def step(self) -> bool:
        """One scheduler step. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        batch = self.get_next_batch()
        t1 = time.perf_counter()
        self.step_time_s["schedule"] += t1 - t0
        if self._worker is None:
            if batch is None:
                return False
            step, out = self._launch(batch)
            assert not isinstance(out, Future)
            t2 = time.perf_counter()
            self.process_result(step, out)
            self.step_time_s["run"] += t2 - t1
            self.step_time_s["post_process"] += time.perf_counter() - t2
            self.last_batch = batch
        else:
            previous = self._inflight
            self._inflight = None
            if batch is not None:
                step, future = self._launch(batch)
                assert isinstance(future, Future)
                self._inflight = (batch, step, future)
            if previous is not None:
                _, prev_step, prev_future = previous
                t2 = time.perf_counter()
                out = prev_future.result()
                t3 = time.perf_counter()
                self.step_time_s["wait"] += t3 - t2
                self.process_result(prev_step, out)
                self.step_time_s["post_process"] += time.perf_counter() - t3
            if batch is None and previous is None:
                return False
            self.last_batch = batch if batch is not None else previous[0] if previous else None
        self.stats["steps"] += 1
        t4 = time.perf_counter()
        self.hook.plugserve_after_step(scheduler=self)
        self.step_time_s["check"] += time.perf_counter() - t4
        return True

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
