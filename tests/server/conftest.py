"""Fixtures of the server tests: a live server on a loopback port, in this process, around an
engine on the tiny random model with the invariant checker at level 1 and physical checks.

`served(ServerSettings(...), **engine_overrides)` starts a server of its own (a special
configuration: an API key, a tiny waiting queue, a small KV pool); `server` is one shared by
a module. Every server is stopped and its engine closed when its test or module ends, and its
memory is checked whole at idle first.

`engine_mode` says where the engine runs: "thread" (a thread of this process, the default) or
"process" (`EngineProcess`: a process of its own, as `plugserve serve --engine-process`). A
module whose tests cross the engine boundary overrides it with both params
(`ENGINE_MODES`); the others run once, in a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.server.background import BackgroundServer
from plugserve.server.settings import ServerSettings
from plugserve.testing.memory import assert_memory_whole

CHECKED = {"mem_check": 1, "check_pages": True}
ENGINE_MODES = ("thread", "process")


def wait_idle(server: BackgroundServer, timeout_s: float = 30.0) -> None:
    """Until nothing runs or waits, then prove memory whole on the engine thread."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        busy = not server.engine_loop.call_method("is_idle")
        if not busy and server.engine_loop.waiting() == 0:
            break
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)
    server.engine_loop.call(assert_memory_whole)


def start_engine(mode: str, model_dir: Path, **overrides: Any) -> Any:
    """The engine of a test server: here, or in a process of its own."""
    if mode == "process":
        from plugserve.config import EngineConfig
        from plugserve.server.engine_process import EngineProcess

        return EngineProcess(EngineConfig(model=str(model_dir), **{**CHECKED, **overrides}))
    return Engine(model=str(model_dir), **{**CHECKED, **overrides})


@contextmanager
def _serve(model_dir: Path, settings: ServerSettings | None, mode: str = "thread",
           **overrides: Any) -> Iterator[BackgroundServer]:
    engine = start_engine(mode, model_dir, **overrides)
    try:
        with BackgroundServer(engine, settings) as server:
            yield server
            wait_idle(server)
        assert server.engine_loop.failure is None
        assert server.engine_loop.idle_memory_problem is None
        if mode == "thread":
            assert_memory_whole(engine)
    finally:
        engine.close()
    if mode == "process":
        assert engine.process.exitcode == 0, engine.process.exitcode


@pytest.fixture(scope="module")
def engine_mode() -> str:
    return "thread"


@pytest.fixture
def served(tiny_model_dir: Path, engine_mode: str
           ) -> Callable[..., AbstractContextManager[BackgroundServer]]:
    def start(settings: ServerSettings | None = None, **overrides: Any
              ) -> AbstractContextManager[BackgroundServer]:
        return _serve(tiny_model_dir, settings, engine_mode, **overrides)

    return start


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, engine_mode: str) -> Iterator[BackgroundServer]:
    with _serve(tiny_model_dir, ServerSettings(max_body_bytes=64 << 10), engine_mode) as live:
        yield live


@pytest.fixture
def http(server: BackgroundServer) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
