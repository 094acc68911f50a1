"""The engine thread: the one thread that touches the engine.

HTTP handlers run on the asyncio loop. They never call the engine: `EngineLoop.submit` and
`EngineLoop.abort` put commands on a thread-safe queue that the engine thread drains between
scheduler steps. After each step the engine thread hands every request's new tokens to that
request's asyncio queue with `loop.call_soon_threadsafe`. A request's events are, in order:
`accepted` (or a final event with `error` set when the engine refused it), `tokens` events,
and one `final` event once its KV is released (finish, abort or engine failure).

The waiting count (submissions not yet drained plus the scheduler's waiting queue) is kept
under a lock so the HTTP side can refuse work with a 503 before it queues any.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from plugserve.outputs import prompt_logprobs_of
from plugserve.sampling import SamplingParams
from plugserve.server.jobs import FINAL_ONLY, Event, Job, RequestHandle, post_all
from plugserve.server.omp_pool import release_openmp_pool

log = logging.getLogger("plugserve.server")

IDLE_WAIT_S = 0.5  # idle: wake at least this often (a stop request also wakes it)
GAUGE_EVERY_S = 0.25  # refresh the running/waiting/KV gauges at most this often while busy


class Overloaded(RuntimeError):
    """The waiting queue is full."""


class NotServing(RuntimeError):
    """The engine loop is shutting down or stopped after an error."""


class EngineLoop:
    def __init__(self, engine: Any, *, max_waiting: int, metrics: Any = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.context_len: int = int(engine.context_len)
        self.vocab_size: int = int(engine.arch.vocab_size)
        self.tokenizer = engine.tokenizer  # read-only: the HTTP side tokenizes and decodes
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0
        self._sched_waiting = 0
        self._accepted = 0  # len(self._active), readable from any thread under the lock
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._active: dict[int, RequestHandle] = {}  # engine thread only
        self._stop_deadline: float | None = None
        self._aborted_for_stop = False
        self._gauges_s = 0.0
        self.failure: BaseException | None = None
        # Where the engine thread's time goes: wall seconds in engine steps and in handing
        # tokens to the HTTP side, and the thread's CPU seconds (the rest of the process's CPU
        # is the HTTP side: parsing, tokenizing, detokenizing, SSE).
        self.time_s: dict[str, float] = {"engine_step": 0.0, "publish": 0.0,
                                         "engine_thread_cpu": 0.0}
        self.idle_memory_problem: str | None = None
        self.idle_checks = 0

    # --- HTTP side --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread. The calling thread (the one that built the engine, as a
        rule) gives up its OpenMP worker pool first: two pools throttle every OpenMP barrier
        of the engine's steps (plugserve.server.omp_pool)."""
        release_openmp_pool()
        self._accepting = True
        self._thread = threading.Thread(target=self._main, name="plugserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def waiting(self) -> int:
        with self._lock:
            return self._queued + self._sched_waiting

    def running(self) -> int:
        """Requests accepted by the engine and not ended, minus those still waiting."""
        with self._lock:
            return max(0, self._accepted - self._sched_waiting)

    def submit(
        self, prompts: list[list[int]], sampling: SamplingParams, arrival_s: float, *,
        session: tuple[str | None, int | None] = (None, None), stream_interval: int = 1,
    ) -> Job:
        """Queue one engine request per prompt and sample (`sampling.num_samples` per prompt;
        the handle of sample j of prompt i has index i * samples + j), or refuse them all
        (Overloaded, NotServing). Token events come every `stream_interval` new tokens
        (plugserve.server.jobs)."""
        if self.failure is not None:
            raise NotServing(f"the engine stopped serving after an internal error: "
                             f"{type(self.failure).__name__}")
        if not self._accepting:
            raise NotServing("the server is shutting down")
        per_prompt = sampling.num_samples
        count = len(prompts) * per_prompt
        with self._lock:
            waiting = self._queued + self._sched_waiting
            if waiting + count > self.max_waiting:
                raise Overloaded(f"{waiting} requests wait already (limit {self.max_waiting})")
            self._queued += count
        job = Job(self, arrival_s)
        job.session = session
        job.stream_interval = stream_interval
        job.handles = [RequestHandle(job, i * per_prompt + j, ids, sampling)
                       for i, ids in enumerate(prompts) for j in range(per_prompt)]
        for i in range(len(prompts)):
            # One command per prompt: the engine submits its samples as one group.
            self._commands.put(("submit", job.handles[i * per_prompt:(i + 1) * per_prompt]))
        self._wake.set()
        return job

    def abort(self, handle: RequestHandle) -> None:
        if not handle.finished:
            self._commands.put(("abort", handle))
            self._wake.set()

    def call(self, fn: Callable[[Any], Any], timeout: float = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread between steps and wait for it (tests,
        diagnostics; never from the event loop: use `call_async` there)."""
        return self._call_future(fn).result(timeout)

    async def call_async(self, fn: Callable[[Any], Any]) -> Any:
        """`call` for a handler: awaits the engine thread's future, so the event loop keeps
        serving (/health among them) while a long step runs."""
        return await asyncio.wrap_future(self._call_future(fn))

    def call_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`call` of the engine method `name` (what the engine process can run too)."""
        return self.call(lambda engine: getattr(engine, name)(*args, **kwargs))

    async def call_method_async(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self.call_async(lambda engine: getattr(engine, name)(*args, **kwargs))

    def compile_grammar(self, spec: Any) -> concurrent.futures.Future[Any]:
        """The engine's grammar compile (its own thread, cached): a Future."""
        future: concurrent.futures.Future[Any] = self.engine.compile_grammar(spec)
        return future

    def rank_problem(self) -> str | None:
        """Why a tensor-parallel rank cannot serve (it died or failed), or None."""
        problem: str | None = self.engine.rank_problem()
        return problem

    def _call_future(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        if self.failure is not None or (self._thread is not None
                                        and not self._thread.is_alive()):
            raise NotServing("the engine loop is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting; let running requests finish for `timeout_s`, abort the rest, wait
        for the engine to go idle (memory whole) and the thread to exit."""
        self._accepting = False
        if self._thread is None:
            return
        self._commands.put(("stop", time.monotonic() + timeout_s))
        self._wake.set()
        self._thread.join(timeout_s + 60.0)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %.0f s", timeout_s + 60.0)

    # --- engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        message, reason = "the server is shutting down", "shutdown"
        try:
            self._serve()
        except BaseException as exc:
            self.failure = exc
            log.error("the engine stopped serving after an error", exc_info=exc)
            message = f"the engine stopped serving after an internal error: {type(exc).__name__}"
            reason = "failed"
            for handle in self._active.values():
                handle.post(Event("final", [], finish_reason=reason, error=message))
            self._active.clear()
            with self._lock:
                self._accepted = 0
        finally:
            self._accepting = False
            self._reject_queued(message, reason)

    def _reject_queued(self, message: str, reason: str) -> None:
        """The thread is leaving: answer whatever is still queued, so nobody waits forever."""
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                for handle in item:
                    handle.post(Event("final", [], finish_reason=reason, error=message))
            elif kind == "call":
                item[1].set_exception(NotServing(message))

    def _serve(self) -> None:
        engine = self.engine
        settled = True  # the engine starts idle
        self._after_idle()  # gauges (the KV terms) before the first request
        while True:
            if self._drain():
                settled = False
            if self._stop_deadline is not None:
                if settled and not self._active:
                    return
                if not self._aborted_for_stop and time.monotonic() >= self._stop_deadline:
                    self._abort_all()
                    settled = False
            if settled:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            progressed = engine.step()
            t1 = time.perf_counter()
            if not progressed and engine.is_idle():
                settled = True
            self._publish(settled)
            self.time_s["engine_step"] += t1 - t0
            self.time_s["publish"] += time.perf_counter() - t1
            self.time_s["engine_thread_cpu"] = time.thread_time()
            if settled:
                self._after_idle()
            else:
                self._refresh_gauges(force=False)

    def _drain(self) -> bool:
        """Apply queued commands; True when any changed the scheduler's work."""
        changed = False
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                with self._lock:
                    self._queued -= len(item)
                try:
                    self._admit(item)
                except BaseException:  # the engine cannot take requests: answer these too
                    for handle in item:
                        handle.post(Event("final", [], finish_reason="failed", error="the "
                                          "engine stopped serving after an internal error"))
                    raise
                changed = True
            elif kind == "abort":
                if item.req is not None and not item.final_posted:
                    self.engine.abort(item.req)
                    changed = True
            elif kind == "call":
                fn, future = item
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)
                changed = True
            elif kind == "stop":
                self._stop_deadline = item
                changed = True
        if changed:
            self._publish(settled=False)
        return changed

    def _admit(self, handles: list[RequestHandle]) -> None:
        """Submit one prompt; its samples (n > 1, best_of) come back as the request's group,
        sample j for handle j."""
        first = handles[0]
        if self._stop_deadline is not None:
            for handle in handles:
                handle.post(Event("final", [], finish_reason="shutdown",
                                  error="the server is shutting down"))
            return
        session_id, session_offset = first.job.session
        req = self.engine.submit(first.ids, first.sampling, session_id=session_id,
                                 session_offset=session_offset)
        if req.error is not None:
            for handle in handles:
                handle.req = req
                handle.post(Event("final", [], finish_reason="error", error=req.error,
                                  prompt_tokens=len(first.ids)))
            return
        assert len(req.group) == len(handles), (len(req.group), len(handles))
        for handle, sample in zip(handles, req.group, strict=True):
            handle.req = sample
            self._active[sample.rid] = handle
            handle.post(Event("accepted", [], prompt_tokens=len(sample.origin_input_ids)))
        with self._lock:
            self._accepted = len(self._active)

    def _abort_all(self) -> None:
        self._aborted_for_stop = True
        for handle in list(self._active.values()):
            self.engine.abort(handle.req)

    def _publish(self, settled: bool) -> None:
        """Hand every request's new tokens to its queue; a final event once it ended."""
        with self._lock:
            self._sched_waiting = self.engine.num_waiting()
        done: list[int] = []
        posts: list[tuple[Any, Event]] = []
        for rid, handle in self._active.items():
            req = handle.req
            final = req.finished() and (
                settled or req.finish_released or req.req_pool_idx is None
            )
            new = req.output_ids[handle.sent:]
            if not final and not _due(handle, len(new)):
                continue
            event = Event("final" if final else "tokens", list(new), *self._logprobs(handle))
            if not handle.prompt_sent:  # the prefill is done: the prompt's logprobs are whole
                handle.prompt_sent = True
                # A forked sample's are its parent's (computed once).
                event.prompt_logprobs, event.prompt_top_logprobs = prompt_logprobs_of(req)
            handle.sent += len(new)
            if final:
                event.finish_reason, event.error, event.stop_str = (
                    req.finished_reason, req.error, req.stop_str)
                event.prompt_tokens, event.cached_tokens = (
                    len(req.origin_input_ids), req.cached_tokens)
                posts.append((handle, event))
                if self.metrics is not None:
                    self.metrics.request_finished(handle, req)
                done.append(rid)
            else:
                posts.append((handle, event))
        self._post_all(posts)
        for rid in done:
            del self._active[rid]
        with self._lock:
            self._accepted = len(self._active)

    def _post_all(self, posts: list[tuple[Any, Event]]) -> None:
        """A step's events, in order: one wake-up of the event loop for all of them (each
        wake-up takes a core from the engine's threads)."""
        post_all(posts)

    @staticmethod
    def _logprobs(handle: RequestHandle) -> tuple[list[float] | None,
                                                  list[list[tuple[int, float]]] | None]:
        """The logprobs (and top alternatives) of the tokens not sent yet, when asked for."""
        req, sent = handle.req, handle.sent
        sp = req.sampling
        if not sp.logprobs:
            return None, None
        values = req.output_logprobs[sent:len(req.output_ids)]
        if sp.top_logprobs <= 0:
            return values, None
        base = len(req.origin_input_ids)
        return values, [req.top_logprobs_at.get(base + k, [])
                        for k in range(sent, len(req.output_ids))]

    def _after_idle(self) -> None:
        problems = self.engine.memory_problems()
        self.idle_memory_problem = "; ".join(problems) if problems else None
        if problems:
            log.error("memory is not whole at idle: %s", self.idle_memory_problem)
        self.idle_checks += 1
        self._refresh_gauges(force=True)

    def _refresh_gauges(self, force: bool) -> None:
        now = time.monotonic()
        if self.metrics is None or (not force and now - self._gauges_s < GAUGE_EVERY_S):
            return
        self._gauges_s = now
        stats = self.engine.stats()
        self.metrics.engine_state(
            running=self.running(), waiting=self.waiting(), terms=self.engine.kv_terms(),
            checker=stats.get("checker", {}), memory_whole=self.idle_memory_problem is None,
            stats=stats,
        )


def _due(handle: Any, new_tokens: int) -> bool:
    """Whether a running request's new tokens go now: a stream's first ones at once, then
    every `stream_interval`; none before the final event when it does not stream."""
    interval = handle.job.stream_interval
    if new_tokens == 0 or interval == FINAL_ONLY:
        return False
    return handle.sent == 0 or new_tokens >= interval
