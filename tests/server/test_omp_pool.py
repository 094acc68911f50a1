"""The engine thread's OpenMP pool is the process's only one: the thread that built the
engine gives up its own (two libgomp pools throttle every barrier's spin-wait)."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from plugserve.server import engine_loop
from plugserve.server.omp_pool import loaded_libgomp, release_openmp_pool

# A thread's libgomp pool is its OS worker threads: with 2 intra-op threads, one worker.
SCRIPT = """
import os, time, torch
from plugserve.server.omp_pool import release_openmp_pool
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
a @ a  # a parallel region on this thread: its pool (one worker) is made
def threads():
    return len(os.listdir("/proc/self/task"))
with_pool = threads()
released = release_openmp_pool()
deadline = time.monotonic() + 10
while threads() >= with_pool and time.monotonic() < deadline:
    time.sleep(0.01)
after = threads()
a @ a  # the pool comes back when this thread runs parallel work again
time.sleep(0.1)
print(released, with_pool, after, threads())
"""


def _libgomp_torch() -> bool:
    import torch

    torch.ones(1)
    return loaded_libgomp() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _libgomp_torch(),
                    reason="torch without GNU OpenMP (libgomp) here")
def test_release_frees_the_calling_threads_pool() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=True)
    released, with_pool, after, again = done.stdout.split()
    assert released == "True"
    assert int(after) == int(with_pool) - 1  # the worker thread ended
    assert int(again) == int(with_pool)


def test_release_without_libgomp_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugserve.server import omp_pool

    monkeypatch.setattr(omp_pool, "loaded_libgomp", lambda: None)
    assert release_openmp_pool() is False


def test_engine_loop_start_releases_the_starting_threads_pool(
        served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both the in-process server and BackgroundServer's caller give their pools up before
    the engine thread runs a step; the engine thread itself keeps its own."""
    callers: list[str] = []
    monkeypatch.setattr(engine_loop, "release_openmp_pool",
                        lambda: callers.append(threading.current_thread().name) or True)
    import httpx

    with served() as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 2
    assert callers == ["plugserve-http"]  # the lifespan's thread, not the engine thread
