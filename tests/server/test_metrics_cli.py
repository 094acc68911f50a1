"""`/metrics`, `/health`, and `plugserve serve` as a user runs it: a subprocess on a loopback
port that answers, then stops on SIGINT / SIGTERM with its memory whole."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_process import free_port, start_serve, wait_healthy

from plugserve.kernels import packed_linear
from plugserve.server.background import BackgroundServer

C = "/v1/completions"


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_metrics_after_requests(served: Any, engine_mode: str) -> None:
    """With --engine-process the engine's figures come over with its step messages."""
    with served() as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(2):
            assert http.post(C, json={"prompt": "Hi there", "max_tokens": 3,
                                      "ignore_eos": True}).status_code == 200
        http.post(C, json={"prompt": "x", "top_p": 0})
        deadline = time.monotonic() + 10  # the idle gauges follow the last answer
        while _checked_steps(text := http.get("/metrics").text) == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    for line in (
        'plugserve_requests_total{outcome="length"}',
        'plugserve_requests_total{outcome="rejected"}',
        "plugserve_prompt_tokens_total",
        "plugserve_generation_tokens_total",
        "plugserve_time_to_first_token_seconds_bucket",
        "plugserve_inter_token_latency_seconds_count",
        "plugserve_request_latency_seconds_sum",
        "plugserve_requests_running 0.0",
        "plugserve_requests_waiting 0.0",
        'plugserve_kv_slots{pool="full",term="available"}',
        'plugserve_kv_slots{pool="full",term="uncached"}',
        'plugserve_kv_slots{pool="full",term="total"}',
        'plugserve_kv_balance_slots{pool="full"} 0.0',
        "plugserve_memory_whole_at_idle 1.0",
        "plugserve_checker_level 1.0",
        "plugserve_engine_up 1.0",
    ):
        assert line in text, line
    assert _metric(text, "plugserve_checker_steps_checked") > 0  # the checker proved the busy steps
    assert _metric(text, "plugserve_weight_bytes") == server.engine.weight_bytes > 0
    # The packs as the server started (the engine process makes them all at start; float32
    # here: the GEMM library packs every linear layer where the CPU kernels are on).
    packs = server.engine.pack_bytes()
    assert _metric(text, "plugserve_weight_pack_bytes") == packs
    if engine_mode == "process" and packed_linear.pack_kind(torch.empty(2, 2)) is not None:
        assert packs > 0
    # The engine's step phases (wall seconds since start), also from the engine process.
    phases = {row.split('"')[1]: float(row.split()[-1]) for row in text.splitlines()
              if row.startswith("plugserve_engine_step_phase_seconds{")}
    assert {"schedule", "run", "forward", "sample"} <= set(phases), phases
    assert phases["run"] >= phases["forward"] > 0


def _checked_steps(metrics: str) -> float:
    return _metric(metrics, "plugserve_checker_steps_checked")


def _metric(metrics: str, name: str) -> float:
    return next(float(row.split()[-1]) for row in metrics.splitlines()
                if row.startswith(name + " "))


def test_health(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200
    document = health.json()
    assert document["status"] == "ok" and document["memory_whole_at_idle"] is True
    assert document["engine_error"] is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_command_stops_on_signal(tiny_model_dir: Path, sig: signal.Signals) -> None:
    port = free_port()
    proc = start_serve(tiny_model_dir, port, "--api-key", "k", "--max-waiting", "8")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(url + "/v1/models", headers=headers).json()
        assert models["data"][0]["id"] == tiny_model_dir.name
        reply = httpx.post(url + C, headers=headers, timeout=30,
                           json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert reply.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"serving {tiny_model_dir.name} on http://127.0.0.1:{port}/v1" in err
    # the resident weight bytes, and the packs the CPU kernels made at start
    assert re.search(r"\d MiB of weights( \+ [\d.]+ MiB of their CPU-kernel packs)?; "
                     r"Ctrl-C stops\)", err), err
    assert "stopped; memory whole at idle: yes" in err
    assert "Traceback" not in err


def test_serve_refuses_a_busy_port(tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_serve(tiny_model_dir, port)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}")


def test_engine_failure(tiny_model_dir: Path) -> None:
    """A step that raises (as a leak found by the checker does) stops the engine: the request
    in flight gets a 500 without a traceback, /health turns 503, new requests get a 503, and
    the HTTP server stays up to say so."""
    from plugserve.engine import Engine

    engine = Engine(model=str(tiny_model_dir), mem_check=1, check_pages=True)
    try:
        with BackgroundServer(engine) as server, \
                httpx.Client(base_url=server.url, timeout=30) as http:
            def break_steps(e: Any) -> None:
                real = e.scheduler.step

                def step() -> bool:
                    if e.scheduler.waiting:  # fails once a request came in
                        raise RuntimeError("simulated step failure")
                    return bool(real())

                e.scheduler.step = step

            server.engine_loop.call(break_steps)
            failed = http.post(C, json={"prompt": "Hi", "max_tokens": 4})
            assert failed.status_code == 500
            error = failed.json()["error"]
            assert error["type"] == "internal_error"
            assert "the engine stopped serving after an internal error: RuntimeError" in \
                error["message"]
            assert "Traceback" not in failed.text
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json()["engine_error"] == "RuntimeError"
            later = http.post(C, json={"prompt": "Hi", "max_tokens": 4})
            assert later.status_code == 503
            assert "plugserve_engine_up 0.0" in http.get("/metrics").text
    finally:
        engine.close()


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_kv_series_before_the_first_request(served: Any) -> None:
    with served() as server:
        text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'plugserve_kv_slots{pool="full",term="available"}' in text
    assert 'plugserve_kv_balance_slots{pool="full"} 0.0' in text
