"""`plugserve serve --engine-process`: the engine in a process of its own.

What only this mode has: the engine process killed with SIGKILL mid-stream (the stream ends
with an error chunk and [DONE], /health answers 503, and once the server is stopped no process
of it is left); an engine that cannot start is reported by the command. The behaviour both
modes share runs in both through the `engine_mode` fixture (tests/server/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from serve_process import alive, children_of, free_port, start_serve, wait_healthy

C = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True,
        "temperature": 0, "n": 8}


def engine_pid(server_pid: int) -> int:
    for pid in children_of(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmd:
            if b"spawn_main" in cmd.read():
                return pid
    raise AssertionError(f"no engine process under {server_pid}: {children_of(server_pid)}")


def test_engine_killed_mid_stream(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = start_serve(tiny_model_dir, port, "--engine-process", "--shutdown-timeout", "0")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        engine = engine_pid(proc.pid)
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            with httpx.Client(timeout=60) as http, http.stream("POST", url + C,
                                                               json=LONG) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60), "the stream did not start"
        os.kill(engine, signal.SIGSTOP)  # frozen mid-stream (8 x 480 tokens take seconds)
        time.sleep(0.2)
        assert lines[-1] != "data: [DONE]", "the stream ended before the engine was stopped"
        os.kill(engine, signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive(), "the stream did not end"
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][6:])
        assert "engine process exited unexpectedly" in last["error"]["message"], last
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        refused = httpx.post(url + C, json={**LONG, "stream": False, "max_tokens": 2, "n": 1},
                             timeout=30)
        assert refused.status_code == 503, refused.text
        helpers = children_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode != 0  # the engine failed: the command says so
    assert "engine" in err and "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in [engine, *helpers]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in [engine, *helpers]), "a process of the server was left"


def test_engine_that_cannot_start_is_reported(tmp_path: Path) -> None:
    port = free_port()
    proc = start_serve(tmp_path / "nothing-here", port, "--engine-process")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "nothing-here" in err, err[-2000:]


def test_orderly_stop_leaves_no_process(tiny_model_dir: Path) -> None:
    port = free_port()
    proc: subprocess.Popen[str] = start_serve(tiny_model_dir, port, "--engine-process")
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        engine = engine_pid(proc.pid)
        body = {**LONG, "stream": False, "max_tokens": 8, "n": 1}
        assert httpx.post(f"http://127.0.0.1:{port}{C}", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "memory whole at idle: yes" in err
    assert not alive(engine)


