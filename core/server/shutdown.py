"""Graceful shutdown: what SIGINT / SIGTERM (or `BackgroundServer.stop`) set going.

1. Draining: the server still accepts connections, but every new generation request gets a
   503 ("shutting down") and /health answers 503 `shutting_down`.
2. Running requests get the grace period (`--shutdown-timeout`) to finish.
3. Whatever still runs then is aborted in the engine (its KV freed like a finish): a stream
   gets a last chunk with `finish_reason: "abort"` and `data: [DONE]`, a non-streaming request
   a 503 error document. The log says how many were aborted.
4. Once every response is written, uvicorn is asked to exit; the lifespan then stops the
   engine thread with the engine idle and its memory whole.

A second signal exits the process at once (as uvicorn and vLLM do).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugserve.server.handlers import ServerState

log = logging.getLogger("plugserve.server")
POLL_S = 0.05
ANSWER_AFTER_ABORT_S = 10.0  # how long aborted responses get to write their last chunk


class GracefulShutdown:
    def __init__(self, state: ServerState, grace_s: float) -> None:
        self.state = state
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self.request_exit: Callable[[], None] = lambda: None  # set by whoever runs uvicorn
        self.started = False
        self.done = False
        self.aborted = 0
        self._task: asyncio.Task[None] | None = None

    def on_signal(self, sig: int) -> None:
        """From a signal handler (any thread): the first starts the drain, a second exits."""
        if self.started:
            log.warning("second signal %d: exiting now, without waiting for running requests",
                        sig)
            os._exit(1)
        self.begin_threadsafe()

    def begin_threadsafe(self) -> None:
        if self.loop is None or self.loop.is_closed():
            self.request_exit()
            return
        self.loop.call_soon_threadsafe(self.begin)

    def begin(self) -> None:
        """On the event loop: start draining (once)."""
        if self.started:
            return
        self.started = True
        self.state.draining = True
        log.info("shutting down: running requests get %.0f s", self.grace_s)
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + self.grace_s
        while state.jobs and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        self.aborted = state.abort_for_shutdown()
        if self.aborted:
            log.warning("shutdown: %d request(s) still running after the %.0f s grace were "
                        "aborted", self.aborted, self.grace_s)
        deadline = time.monotonic() + ANSWER_AFTER_ABORT_S
        while state.jobs and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        self.done = True
        self.request_exit()
