"""The engine process of `plugserve serve --engine-process`: the engine and its loop, no HTTP.

Started by `plugserve.server.engine_process.EngineProcess` with torch.multiprocessing (spawn).
Two threads: the main thread reads the HTTP process's commands from its pipe (submit, abort,
call, compile, stop) and hands them to the engine thread, which is `EngineLoop`'s own loop
(`WorkerLoop`). After each scheduler step the engine thread sends ONE message carrying every
request's new tokens (the step's events), the finished requests' figures for the metrics and,
at most every `GAUGE_EVERY_S`, the KV gauges and engine stats.

Messages to the HTTP process: ("ready", info), ("step", events, finished, state),
("reply", call_id, ok, value), ("stopped", state) and ("failed", message) when the engine
could not start. The process ends when the HTTP process is gone (its pipe closes, or its pid
changes), so a killed server never leaves an engine behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from plugserve.server.engine_loop import EngineLoop
from plugserve.server.jobs import Event

log = logging.getLogger("plugserve.server")
PARENT_POLL_S = 0.5
POLL_S = 0.1  # how often the pipe reader looks at the engine thread while nothing comes


class Outbox:
    """The engine process's side of the pipe: sends from any thread, one at a time."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):  # the HTTP process is gone: the watcher ends us
                pass


class WorkerJob:
    def __init__(self, session: tuple[str | None, int | None], arrival_s: float,
                 stream_interval: int) -> None:
        self.session = session
        self.arrival_s = arrival_s
        self.stream_interval = stream_interval


class WorkerHandle:
    """The engine side of one HTTP request handle: `post` queues the event for the step's
    message instead of an asyncio queue."""

    def __init__(self, loop: WorkerLoop, key: int, ids: list[int], sampling: Any,
                 job: WorkerJob) -> None:
        self.loop = loop
        self.key = key
        self.ids = ids
        self.sampling = sampling
        self.job = job
        self.finished = False
        self.req: Any = None
        self.sent = 0
        self.prompt_sent = False
        self.final_posted = False

    @property
    def arrival_s(self) -> float:
        return self.job.arrival_s

    def post(self, event: Event) -> None:
        if event.kind == "final":
            self.final_posted = True
            self.loop.handles.pop(self.key, None)
        self.loop.events.append((self.key, event))


class Recorder:
    """Stands in for the server's metrics in the engine process: what the metrics need is sent
    with the step's message and written by the HTTP process."""

    def __init__(self) -> None:
        self.finished: list[tuple[int, dict[str, Any]]] = []
        self.gauges: dict[str, Any] | None = None

    def request_finished(self, handle: WorkerHandle, req: Any) -> None:
        self.finished.append((handle.key, {
            "reason": str(req.finished_reason), "prompt_tokens": len(req.origin_input_ids),
            "output_tokens": len(req.output_ids), "first_token_s": req.first_token_s,
            "token_times_s": list(req.token_times_s), "finished_s": req.finished_s}))

    def engine_state(self, **gauges: Any) -> None:
        self.gauges = gauges


class WorkerLoop(EngineLoop):
    """`EngineLoop` whose events leave as one message per step."""

    def __init__(self, engine: Any, outbox: Outbox) -> None:
        self.recorder = Recorder()
        super().__init__(engine, max_waiting=1 << 30, metrics=self.recorder)
        self.outbox = outbox
        self.events: list[tuple[int, Event]] = []
        self.handles: dict[int, WorkerHandle] = {}
        self._cpu0 = _process_cpu()  # the engine is built: count serving CPU from here

    def enqueue(self, handles: list[WorkerHandle]) -> None:
        for handle in handles:
            self.handles[handle.key] = handle
        with self._lock:
            self._queued += len(handles)
        self._commands.put(("submit", handles))
        self._wake.set()

    def abort_key(self, key: int) -> None:
        handle = self.handles.get(key)
        if handle is not None:
            self.abort(handle)

    def _post_all(self, posts: list[tuple[Any, Event]]) -> None:
        for handle, event in posts:
            handle.post(event)

    def _publish(self, settled: bool) -> None:
        super()._publish(settled)
        self.flush()

    def _after_idle(self) -> None:
        super()._after_idle()
        self.flush()

    def _main(self) -> None:
        try:
            super()._main()
        finally:
            self.flush()

    def state(self) -> dict[str, Any]:
        with self._lock:
            state: dict[str, Any] = {"sched_waiting": self._sched_waiting,
                                     "accepted": self._accepted}
        state["time_s"] = {**self.time_s, "engine_process_cpu": _process_cpu() - self._cpu0}
        state["idle_checks"] = self.idle_checks
        state["idle_memory_problem"] = self.idle_memory_problem
        state["failure"] = (None if self.failure is None
                            else f"{type(self.failure).__name__}: {self.failure}")
        return state

    def flush(self) -> None:
        """One message: this step's events, finished requests and (when refreshed) gauges."""
        rec = self.recorder
        if not self.events and not rec.finished and rec.gauges is None:
            return
        events, self.events = self.events, []
        finished, rec.finished = rec.finished, []
        state = self.state()
        if rec.gauges is not None:
            state["gauges"] = rec.gauges
            state["rank_problem"] = self.engine.rank_problem()
            rec.gauges = None
        self.outbox.send(("step", events, finished, state))


def _process_cpu() -> float:
    cpu = os.times()
    return cpu.user + cpu.system


def worker_main(conn: Any, config: Any, plugins: tuple[str, ...], parent_pid: int,
                log_level: str) -> None:
    """The engine process's entry point (spawned): build the engine, serve the pipe."""
    # Ctrl-C (and `timeout`, `kill -- -PGID`) signal the whole group: the HTTP process runs
    # the shutdown (grace, aborts) and stops this one; when it is gone the watcher ends this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    _watch_parent(parent_pid)
    outbox = Outbox(conn)
    try:
        from plugserve.engine import Engine
        from plugserve.model.batch_packs import make_batch_packs

        engine = Engine(config, plugins=plugins)
        make_batch_packs(engine.model)
    except BaseException as exc:
        outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        loop = WorkerLoop(engine, outbox)
        outbox.send(("ready", {"tokenizer": engine.tokenizer,
                               "context_len": loop.context_len,
                               "vocab_size": loop.vocab_size,
                               "weight_bytes": engine.weight_bytes,
                               "pack_bytes": engine.pack_bytes()}))
        loop.start()
        _serve_pipe(conn, loop, outbox)
        outbox.send(("stopped", loop.state()))
    finally:
        engine.close()


def _serve_pipe(conn: Any, loop: WorkerLoop, outbox: Outbox) -> None:
    """Until the engine thread ended after a stop (or failed), or the HTTP process is gone.
    Aborts keep coming while a stop waits for running requests."""
    stopping = False
    rank_problem: str | None = None
    while True:
        # A TP rank died, also while the engine idles. Asked before the engine thread's end
        # is seen: a step that failed because a rank died ends the thread, and the HTTP side
        # must still learn which rank (a failure alone reaches /health as its type).
        problem = loop.engine.rank_problem()
        if problem != rank_problem:
            rank_problem = problem
            outbox.send(("step", [], [], {**loop.state(), "rank_problem": problem}))
        thread = loop._thread
        if thread is None or not thread.is_alive():
            return
        try:
            if not conn.poll(POLL_S):
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone: stop at once
            loop.stop(0.0)
            return
        kind = message[0]
        if kind == "submit":
            _, samples, session, arrival_s, stream_interval = message
            job = WorkerJob(session, arrival_s, stream_interval)
            loop.enqueue([WorkerHandle(loop, key, ids, sampling, job)
                          for key, ids, sampling in samples])
        elif kind == "abort":
            loop.abort_key(message[1])
        elif kind == "call":
            _call(loop, outbox, *message[1:])
        elif kind == "compile":
            _compile(loop, outbox, message[1], message[2])
        elif kind == "stop" and not stopping:
            stopping = True
            loop._accepting = False
            loop._commands.put(("stop", time.monotonic() + message[1]))
            loop._wake.set()


def _call(loop: WorkerLoop, outbox: Outbox, call_id: int, fn: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> None:
    """`fn` is a method name of the engine or a picklable function of the engine; it runs on
    the engine thread between steps."""
    def run(engine: Any) -> Any:
        target = getattr(engine, fn) if isinstance(fn, str) else (lambda *a, **k: fn(engine, *a,
                                                                                     **k))
        return target(*args, **kwargs)

    try:
        future = loop._call_future(run)
    except BaseException as exc:
        outbox.send(("reply", call_id, False, exc))
        return
    future.add_done_callback(lambda f: _reply(outbox, call_id, f))


def _compile(loop: WorkerLoop, outbox: Outbox, call_id: int, spec: Any) -> None:
    """A grammar compiled (cached) on the grammar service's thread; only its outcome goes back
    (the compiled grammar stays here, where the sampler uses it)."""
    try:
        future = loop.engine.compile_grammar(spec)
    except BaseException as exc:
        outbox.send(("reply", call_id, False, exc))
        return
    future.add_done_callback(
        lambda f: outbox.send(("reply", call_id, f.exception() is None, f.exception())))


def _reply(outbox: Outbox, call_id: int, future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        outbox.send(("reply", call_id, False, exc))
        return
    try:
        outbox.send(("reply", call_id, True, future.result()))
    except Exception as pickling:  # a result that cannot cross the pipe
        outbox.send(("reply", call_id, False, TypeError(f"result not sendable: {pickling}")))


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="plugserve-parent-watch", daemon=True).start()
