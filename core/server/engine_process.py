"""`EngineProcess`: the engine in a process of its own (`plugserve serve --engine-process`).

The HTTP process keeps FastAPI/uvicorn, tokenizing, detokenizing and SSE; the engine and its
scheduler loop run in a process started with torch.multiprocessing (spawn), as vLLM's engine
core and SGLang's scheduler do, so neither side waits for the other's GIL. One pipe joins
them: submissions, aborts, calls and the stop go in; ONE message per engine step comes out with
every request's new tokens, the finished requests' figures and the gauges
(`plugserve.server.engine_worker`).

To the HTTP side it is what `EngineLoop` is (submit, abort, call, stop, waiting, running,
alive, the time split, the idle memory check), plus what `create_app` reads off an engine
(config, host, tokenizer). When the engine process dies, every open request ends with a
"failed" event (streams get an error chunk and [DONE]) and /health answers 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from plugserve.sampling import SamplingParams
from plugserve.server.engine_loop import NotServing, Overloaded
from plugserve.server.jobs import Event, Job, RequestHandle, post_all

log = logging.getLogger("plugserve.server")
START_TIMEOUT_S = 1800.0  # the first start compiles the CPU kernels
STOP_SLACK_S = 60.0


class EngineProcess:
    def __init__(self, config: Any, plugins: tuple[str, ...] | list[str] = (), *,
                 log_level: str = "WARNING", start_timeout_s: float = START_TIMEOUT_S) -> None:
        import torch.multiprocessing as mp

        from plugserve.plugins import load_plugins
        from plugserve.server.engine_worker import worker_main

        self.config = config
        # The tool-call parsers live in the HTTP process (they read the decoded text).
        self.host = load_plugins(plugins, allowlist=config.plugins)
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe(duplex=True)
        # Not daemonic: with --tp the engine process starts the other ranks itself.
        self.process = context.Process(
            target=worker_main, name="plugserve-engine", daemon=False,
            args=(child_conn, config, tuple(plugins), os.getpid(), log_level))
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        info = self._await_ready(start_timeout_s)
        self.tokenizer = info["tokenizer"]
        self.context_len: int = int(info["context_len"])
        self.weight_bytes: int = int(info["weight_bytes"])
        self._pack_bytes: int = int(info["pack_bytes"])
        self.vocab_size: int = int(info["vocab_size"])
        self.max_waiting = 1 << 30
        self.metrics: Any = None
        self.failure: BaseException | None = None
        self.time_s: dict[str, float] = {}
        self.idle_memory_problem: str | None = None
        self.idle_checks = 0
        self._rank_problem: str | None = None
        self._gauges: dict[str, Any] | None = None
        self._accepting = False
        self._handles: dict[int, RequestHandle] = {}
        self._unadmitted: set[int] = set()
        self._sched_waiting = 0
        self._accepted = 0
        self._keys = itertools.count()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._stopped = threading.Event()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="plugserve-engine-pipe",
                                        daemon=True)
        self._reader.start()

    def _await_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(0.5):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "ready":
                    return dict(payload)
                self._end_process()
                raise RuntimeError(f"the engine process could not start: {payload}")
            if not self.process.is_alive():
                break
        self._end_process()
        raise RuntimeError(f"the engine process did not start (exit code "
                           f"{self.process.exitcode}, waited up to {timeout_s:.0f} s)")

    # --- what create_app and the handlers use (EngineLoop's interface) ---------------------
    def pack_bytes(self) -> int:
        """The CPU kernels' packs of the weights, as the engine process made them at start."""
        return self._pack_bytes

    def attach(self, *, max_waiting: int, metrics: Any) -> EngineProcess:
        self.max_waiting = max_waiting
        self.metrics = metrics
        if self._gauges is not None:  # the KV series before the first request
            self._write_gauges(self._gauges)
        return self

    def start(self) -> None:
        self._accepting = True

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process.is_alive()

    def waiting(self) -> int:
        with self._lock:
            return len(self._unadmitted) + self._sched_waiting

    def running(self) -> int:
        with self._lock:
            return max(0, self._accepted - self._sched_waiting)

    def rank_problem(self) -> str | None:
        return self._rank_problem

    def submit(self, prompts: list[list[int]], sampling: SamplingParams, arrival_s: float, *,
               session: tuple[str | None, int | None] = (None, None),
               stream_interval: int = 1) -> Job:
        if self.failure is not None:
            raise NotServing(f"the engine stopped serving: {self.failure}")
        if not self._accepting:
            raise NotServing("the server is shutting down")
        per_prompt = sampling.num_samples
        job = Job(self, arrival_s)
        job.session = session
        job.stream_interval = stream_interval
        job.handles = [RequestHandle(job, i * per_prompt + j, ids, sampling)
                       for i, ids in enumerate(prompts) for j in range(per_prompt)]
        with self._lock:
            waiting = len(self._unadmitted) + self._sched_waiting
            if waiting + len(job.handles) > self.max_waiting:
                raise Overloaded(f"{waiting} requests wait already (limit {self.max_waiting})")
            for handle in job.handles:
                handle.key = next(self._keys)
                self._handles[handle.key] = handle
                self._unadmitted.add(handle.key)
        try:
            for i in range(len(prompts)):  # one message per prompt: its samples are one group
                group = job.handles[i * per_prompt:(i + 1) * per_prompt]
                self._send(("submit", [(h.key, h.ids, sampling) for h in group], session,
                            arrival_s, stream_interval))
        except NotServing:  # the engine process is gone: nobody would answer these
            with self._lock:
                for handle in job.handles:
                    self._handles.pop(handle.key, None)
                    self._unadmitted.discard(handle.key)
            raise
        return job

    def abort(self, handle: RequestHandle) -> None:
        if not handle.finished and handle.key in self._handles:
            try:
                self._send(("abort", handle.key))
            except NotServing:
                pass  # the engine process is gone: its requests were ended already

    def compile_grammar(self, spec: Any) -> concurrent.futures.Future[Any]:
        """A Future that is done once the engine process compiled `spec` (cached there), or
        fails with its GrammarError."""
        return self._request(lambda call_id: ("compile", call_id, spec))

    def call(self, fn: Callable[[Any], Any] | str, timeout: float = 60.0, *args: Any,
             **kwargs: Any) -> Any:
        """Run `fn(engine)` (a picklable function, or an engine method's name with `args`) on
        the engine thread between steps, and wait for its result (tests, diagnostics)."""
        return self._call_future(fn, args, kwargs).result(timeout)

    def call_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call_future(name, args, kwargs).result(60.0)

    async def call_method_async(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.wrap_future(self._call_future(name, args, kwargs))

    def _call_future(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> concurrent.futures.Future[Any]:
        return self._request(lambda call_id: ("call", call_id, fn, args, kwargs))

    def _request(self, message: Callable[[int], tuple[Any, ...]]
                 ) -> concurrent.futures.Future[Any]:
        if not self.alive:
            raise NotServing("the engine process is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._keys)
            self._calls[call_id] = future
        self._send(message(call_id))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting; running requests get `timeout_s`, the rest are aborted; wait for the
        engine to go idle (memory whole) and its process to exit."""
        self._accepting = False
        if self.process.is_alive() and not self._stopped.is_set():
            try:
                self._send(("stop", timeout_s))
                self._stopped.wait(timeout_s + STOP_SLACK_S)
            except NotServing:
                pass
        self._end_process()

    def close(self) -> None:
        """Stop (no grace) and release the pipe: what `Engine.close` is to an engine."""
        if self._closed:
            return
        self.stop(0.0)
        self._closed = True
        self.conn.close()

    def _end_process(self) -> None:
        self.process.join(30.0)
        if self.process.is_alive():
            log.error("the engine process did not exit; killing it")
            self.process.kill()
            self.process.join(10.0)

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, ValueError):
                raise NotServing("the engine process is not running") from None

    # --- the pipe reader thread ---------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, ValueError):
                self._gone()
                return
            kind = message[0]
            if kind == "step":
                self._on_step(*message[1:])
            elif kind == "reply":
                _, call_id, ok, value = message
                with self._lock:
                    future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_result(value) if ok else future.set_exception(value)
            elif kind == "stopped":
                self._apply_state(message[1])
                self._stopped.set()

    def _on_step(self, events: list[tuple[int, Event]],
                 finished: list[tuple[int, dict[str, Any]]], state: dict[str, Any]) -> None:
        if self.metrics is not None:
            for key, figures in finished:
                handle = self._handles.get(key)
                if handle is not None:
                    self.metrics.request_finished(handle, _finished_req(figures))
        posts: list[tuple[RequestHandle, Event]] = []
        with self._lock:
            for key, event in events:
                handle = self._handles.get(key)
                if handle is None:
                    continue
                if event.kind != "tokens":
                    self._unadmitted.discard(key)
                if event.kind == "final":
                    del self._handles[key]
                posts.append((handle, event))
        self._apply_state(state)
        post_all(posts)  # one wake-up of each event loop per step

    def _apply_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._sched_waiting = int(state["sched_waiting"])
            self._accepted = int(state["accepted"])
        self.time_s = state["time_s"]
        self.idle_checks = int(state["idle_checks"])
        self.idle_memory_problem = state["idle_memory_problem"]
        if state.get("failure") and self.failure is None:
            self.failure = RuntimeError(state["failure"])
        if "rank_problem" in state:
            self._rank_problem = state["rank_problem"]
        if "gauges" in state:
            self._gauges = state["gauges"]
            if self.metrics is not None:
                self._write_gauges(state["gauges"])

    def _write_gauges(self, gauges: dict[str, Any]) -> None:
        self.metrics.engine_state(**{**gauges, "running": self.running(),
                                     "waiting": self.waiting()})

    def _gone(self) -> None:
        """The pipe closed: after a stop that is the end; otherwise the engine process died,
        and everyone still waiting on it is answered."""
        if self._stopped.is_set():
            return
        self.process.join(5.0)
        message = (f"the engine process exited unexpectedly (exit code "
                   f"{self.process.exitcode})")
        self.failure = RuntimeError(message)
        log.error("%s; open requests are ended", message)
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._unadmitted.clear()
            self._accepted = self._sched_waiting = 0
            calls = list(self._calls.values())
            self._calls.clear()
        for handle in handles:
            handle.post(Event("final", [], finish_reason="failed", error=message))
        for future in calls:
            future.set_exception(NotServing(message))
        if self.metrics is not None:
            self.metrics.set_engine_up(False)


def _finished_req(figures: dict[str, Any]) -> Any:
    """What ServerMetrics.request_finished reads off a finished request."""
    return SimpleNamespace(finished_reason=figures["reason"],
                           origin_input_ids=range(figures["prompt_tokens"]),
                           output_ids=range(figures["output_tokens"]),
                           first_token_s=figures["first_token_s"],
                           token_times_s=figures["token_times_s"],
                           finished_s=figures["finished_s"])
