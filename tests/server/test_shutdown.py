"""Shutdown as clients see it: SIGTERM on a real `plugserve serve` process with streams and a
plain request running (streams end with finish_reason "abort" and [DONE], the plain request
gets a 503 document, the log counts the aborts, no traceback, memory whole); a second signal
exits at once; while draining, new requests get a 503 and running ones may finish."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import free_port, start_serve, wait_healthy

from plugserve.engine import Engine
from plugserve.server.background import BackgroundServer
from plugserve.server.settings import ServerSettings

C = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True,
        "temperature": 0}


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=60)


def _stream_lines(url: str, out: list[Any], started: threading.Event) -> None:
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", url + C, json=LONG) as resp:
            out.append(resp.status_code)
            for line in resp.iter_lines():
                if line:
                    out.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        out.append(exc)
    started.set()


@pytest.mark.parametrize("mode", ["--no-engine-process", "--engine-process"])
def test_sigterm_ends_streams_with_abort_and_done(tiny_model_dir: Path, mode: str) -> None:
    port = free_port()
    proc = start_serve(tiny_model_dir, port, "--shutdown-timeout", "0", mode)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        streams: list[list[Any]] = [[] for _ in range(3)]
        events = [threading.Event() for _ in streams]
        threads = [threading.Thread(target=_stream_lines, args=(url, s, e))
                   for s, e in zip(streams, events, strict=True)]
        plain: dict[str, Any] = {}

        def post_plain() -> None:
            body = {**LONG, "stream": False}
            try:
                plain["response"] = httpx.post(url + C, json=body, timeout=60)
            except httpx.HTTPError as exc:
                plain["response"] = exc

        threads.append(threading.Thread(target=post_plain))
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(60), "no stream started"
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).json()["running"] < 4:
            assert time.monotonic() < deadline, "the plain request never ran"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.returncode is None:
            _stop(proc)
    for lines in streams:
        assert lines[0] == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(ln[6:]) for ln in lines[1:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "abort", finishes[-3:]
    response = plain["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 503
    assert "shut down before the request finished" in response.json()["error"]["message"]
    assert proc.returncode == 0, err
    assert "4 request(s) still running after the 0 s grace were aborted" in err
    assert "stopped; 4 request(s) aborted at shutdown; memory whole at idle: yes" in err
    assert "Traceback" not in err and "CancelledError" not in err


def test_second_signal_exits_at_once(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = start_serve(tiny_model_dir, port, "--shutdown-timeout", "60")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        lines: list[Any] = []
        started = threading.Event()
        thread = threading.Thread(target=_stream_lines, args=(url, lines, started))
        thread.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        thread.join(30)
    finally:
        _, err = _stop(proc)
    assert elapsed < 10
    assert proc.returncode == 1
    assert "second signal" in err


def test_draining_refuses_new_requests_and_lets_running_ones_finish(
        tiny_model_dir: Path) -> None:
    engine = Engine(model=str(tiny_model_dir), mem_check=1, check_pages=True)
    try:
        server = BackgroundServer(engine, ServerSettings(shutdown_timeout_s=60)).start()
        lines: list[Any] = []
        started = threading.Event()
        thread = threading.Thread(target=_stream_lines, args=(server.url, lines, started))
        try:
            thread.start()
            assert started.wait(60)
            server.app.state.shutdown.begin_threadsafe()
            time.sleep(0.2)
            refused = httpx.post(server.url + C, json={"prompt": "Hi", "max_tokens": 2},
                                 timeout=30)
            assert refused.status_code == 503
            assert "shutting down" in refused.json()["error"]["message"]
            health = httpx.get(server.url + "/health", timeout=30)
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            thread.join(60)
        finally:
            server.stop()
        assert lines[-1] == "data: [DONE]"
        finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"]
                    for ln in lines[1:-1] if json.loads(ln[6:])["choices"]]
        assert finishes[-1] == "length"  # it ran to its end within the grace
        assert server.engine_loop.idle_memory_problem is None
    finally:
        engine.close()
