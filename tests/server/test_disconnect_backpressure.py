"""A client that goes away aborts its request (memory whole at idle, proven on the engine
thread); a full waiting queue answers 503 with Retry-After; shutdown leaves memory whole."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest

from plugserve.server.background import BackgroundServer
from plugserve.server.settings import ServerSettings
from plugserve.testing.memory import assert_memory_whole
from tests.server.conftest import wait_idle

C = "/v1/completions"
LONG = {"prompt": "Tell me everything", "max_tokens": 400, "temperature": 0, "stream": True,
        "ignore_eos": True}


def counter(http: httpx.Client, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{want}}}" if want else "")) + r" ([0-9.e+]+)"
    found = re.search(pattern, http.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def wait_for(check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stream_disconnect_aborts(server: BackgroundServer, http: httpx.Client) -> None:
    aborted = counter(http, "plugserve_requests_total", outcome="abort")
    tokens = counter(http, "plugserve_generation_tokens_total")
    with httpx.Client(base_url=server.url, timeout=30) as client, \
            client.stream("POST", C, json=LONG) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for _, line in zip(range(6), lines, strict=False) if line]
        assert len(got) == 3  # three chunks read, then the client goes away
    wait_for(lambda: counter(http, "plugserve_requests_total", outcome="abort") == aborted + 1)
    wait_idle(server)  # memory whole, proven on the engine thread
    generated = counter(http, "plugserve_generation_tokens_total") - tokens
    assert 3 <= generated < 400, generated


def test_non_stream_disconnect_aborts(server: BackgroundServer, http: httpx.Client) -> None:
    aborted = counter(http, "plugserve_requests_total", outcome="abort")
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url) as client:
        client.post(C, json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_for(lambda: counter(http, "plugserve_requests_total", outcome="abort") == aborted + 1)
    wait_idle(server)
    assert http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_disconnect_while_waiting(served: Any) -> None:
    """A request still queued behind another is aborted too: it never runs."""
    with served(ServerSettings(max_waiting=4), max_running_requests=1) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", C, json=LONG) as first:
        lines = first.iter_lines()  # keep it: a dropped iterator closes the response
        next(lines)
        with http.stream("POST", C, json=LONG) as second:
            assert second.status_code == 200
            wait_for(lambda: server.engine_loop.waiting() == 1)
        wait_for(lambda: server.engine_loop.waiting() == 0)
        assert counter(http, "plugserve_requests_total", outcome="abort") == 1
        running = server.engine_loop.call(
            lambda e: [len(r.output_ids) > 0 for r in e.scheduler.running_batch.reqs])
        assert running == [True]  # the first one still runs


def test_backpressure_503(served: Any) -> None:
    with served(ServerSettings(max_waiting=1, retry_after_s=2), max_running_requests=1) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        queued: dict[str, Any] = {}

        def wait_in_queue() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as other:
                queued["response"] = other.post(C, json={**LONG, "stream": False,
                                                         "max_tokens": 4})

        thread = threading.Thread(target=wait_in_queue)
        with http.stream("POST", C, json=LONG) as first:
            lines = first.iter_lines()
            next(lines)  # running: it holds the only request row
            thread.start()
            wait_for(lambda: server.engine_loop.waiting() == 1)
            refused = http.post(C, json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "2"
            error = refused.json()["error"]
            assert error["type"] == "overloaded_error"
            assert "1 requests wait already (limit 1)" in error["message"]
            assert counter(http, "plugserve_requests_total", outcome="overloaded") == 1
            assert counter(http, "plugserve_requests_waiting") == 1
            # A bad request is still told what is wrong: a 503 would invite a retry.
            bad = http.post(C, json={"prompt": "Hi", "top_p": 0})
            assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]
        # The first client went away: its row is free, the queued request runs.
        thread.join(60)
        assert queued["response"].status_code == 200
        assert queued["response"].json()["usage"]["completion_tokens"] == 4
        assert http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_shutdown_aborts_running_and_leaves_memory_whole(tiny_model_dir: Any) -> None:
    from plugserve.engine import Engine

    engine = Engine(model=str(tiny_model_dir), mem_check=1, check_pages=True)
    try:
        server = BackgroundServer(engine, ServerSettings(shutdown_timeout_s=0)).start()
        results: list[Any] = []

        def stream() -> None:
            try:
                with httpx.Client(base_url=server.url, timeout=30) as http, \
                        http.stream("POST", C, json=LONG) as response:
                    results.extend(response.iter_lines())
            except httpx.HTTPError as exc:
                results.append(exc)

        thread = threading.Thread(target=stream)
        thread.start()
        wait_for(lambda: len(results) > 0 or server.engine_loop.waiting() == 0)
        time.sleep(0.3)
        server.stop()
        thread.join(30)
        loop = server.engine_loop
        assert not loop.alive and loop.failure is None
        assert loop.idle_memory_problem is None
        assert_memory_whole(engine)  # the engine thread exited: safe to look
    finally:
        engine.close()


def test_engine_refusal_after_queueing(served: Any) -> None:
    """What only the engine can judge (the KV pool's size) is refused at submit: a 400 with
    the engine's words, and nothing stays queued."""
    with served(kv_pool_tokens=64) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        refused = http.post(C, json={"prompt": [5] * 100, "max_tokens": 4})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert "request needs up to 104 KV slots but the pool holds 64" in error["message"]
        assert server.engine_loop.waiting() == 0
        assert http.post(C, json={"prompt": [5] * 10, "max_tokens": 4}).status_code == 200
