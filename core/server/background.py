"""`BackgroundServer`: the app under uvicorn in a background thread, on a loopback port.

For tests, the chaos soak and benchmarks that want a live server in their own process:

    with BackgroundServer(engine, ServerSettings(max_waiting=4)) as server:
        httpx.get(server.url + "/health")
        server.engine_loop.call(assert_memory_whole)   # on the engine thread

The port is picked by the OS (bound before uvicorn starts, so two servers never race for
one). Leaving the block stops the server like SIGTERM does (`plugserve.server.shutdown`: the
grace period, aborts, then the lifespan stops the engine thread); the engine itself is left
to its owner to close.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from plugserve.server.omp_pool import release_openmp_pool
from plugserve.server.settings import ServerSettings


class BackgroundServer:
    def __init__(self, engine: Any, settings: ServerSettings | None = None,
                 log_level: str = "warning", port: int = 0) -> None:
        import uvicorn

        from plugserve.server.app import create_app

        self.settings = settings or ServerSettings()
        if self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("BackgroundServer binds to loopback only")
        self.engine = engine  # an Engine, or an EngineProcess
        self.app = create_app(engine, self.settings)
        self.engine_loop = self.app.state.engine_loop
        self.metrics = self.app.state.metrics
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))  # 0: a free port (settings.port is the CLI's)
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=int(self.settings.shutdown_timeout_s))
        self.server = uvicorn.Server(config)
        self.app.state.shutdown.request_exit = self._exit
        self._thread = threading.Thread(target=self._run, name="plugserve-http", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._socket])
        except BaseException as exc:
            self.error = exc

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        # The engine thread is started from the uvicorn thread: the caller's thread (which
        # built the engine, as a rule) gives up its OpenMP pool here (plugserve.server.omp_pool).
        release_openmp_pool()
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.error!r}")
            time.sleep(0.02)
        return self

    def _exit(self) -> None:
        self.server.should_exit = True

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop like SIGTERM does: drain (the grace period, then aborts), then exit."""
        if self._thread.is_alive():
            self.app.state.shutdown.begin_threadsafe()
        self._thread.join(timeout_s)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError("the server thread did not stop")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
