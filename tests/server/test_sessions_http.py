"""Streaming sessions over HTTP: open, turns (completions with session_id, through the
official openai client's extra_body), rewind, errors, close; memory whole at idle."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import openai
import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.server.background import BackgroundServer

TURNS = [[5, 6, 7, 8, 9], [40, 41, 42], [90, 91]]
OUT = 6


def _plain_turns(model: Path) -> list[list[int]]:
    """Reference: the whole conversation re-sent each turn, no session."""
    outputs, history = [], []
    with Engine(model=str(model), cache="none") as engine:
        for turn in TURNS:
            history = history + turn
            out = engine.generate([history], SamplingParams(max_new_tokens=OUT,
                                                            ignore_eos=True))[0].token_ids
            outputs.append(out)
            history = history + out
    return outputs


def _turn(client: openai.OpenAI, prompt: list[int], **extra: Any) -> Any:
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=OUT, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_turns_match_the_whole_conversation(
    served: Callable[..., AbstractContextManager[BackgroundServer]], tiny_model_dir: Path
) -> None:
    expected = _plain_turns(tiny_model_dir)
    with served(cache="streaming_session") as server:
        import httpx

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            opened = http.post("/v1/sessions", json={"timeout_s": 60})
            assert opened.status_code == 200, opened.text
            sid = opened.json()["id"]
            got = []
            for turn in TURNS:
                out = _turn(client, turn, session_id=sid)
                got.append(out.choices[0].model_extra["token_ids"])
                assert out.usage.completion_tokens == OUT
            assert got == expected
            # Rewind to the first turn's prompt + reply, then the second turn again.
            again = _turn(client, TURNS[1], session_id=sid,
                          session_offset=len(TURNS[0]) + OUT)
            assert again.choices[0].model_extra["token_ids"] == expected[1]

            # Errors: unknown session (404), bad offset (400), close twice (404), open
            # without a body (defaults).
            for extra, status in (({"session_id": "session-999"}, 404),
                                  ({"session_id": sid, "session_offset": 10_000}, 400),
                                  ({"session_offset": 3}, 400)):
                bad = http.post("/v1/completions", json={
                    "prompt": [3, 4], "max_tokens": 2, **extra})
                assert bad.status_code == status, bad.text
                assert "session" in bad.json()["error"]["message"]
            assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
            gone = http.delete(f"/v1/sessions/{sid}")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
            second = http.post("/v1/sessions")
            assert second.status_code == 200
            assert http.delete(f"/v1/sessions/{second.json()['id']}").status_code == 200
            # A good request right after is served.
            assert _turn(client, [3, 4, 5]).usage.completion_tokens == OUT


def test_sessions_need_the_streaming_session_policy(http: Any) -> None:
    refused = http.post("/v1/sessions")
    assert refused.status_code == 400
    assert "streaming_session" in refused.json()["error"]["message"]


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_sessions_bound_to_their_key_and_unguessable(
    served: Callable[..., AbstractContextManager[BackgroundServer]]
) -> None:
    import httpx

    from plugserve.server.settings import ServerSettings

    with served(ServerSettings(api_key="k1,k2"), cache="streaming_session") as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        one, two = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))
        sids = [http.post("/v1/sessions", headers=one).json()["id"] for _ in range(2)]
        assert sids[0] != sids[1] and all(len(s) >= 32 for s in sids)  # uuid4, not a counter
        body = {"prompt": [3, 4], "max_tokens": 2, "session_id": sids[0]}
        stolen = http.post("/v1/completions", json=body, headers=two)
        assert stolen.status_code == 404
        assert stolen.json()["error"]["code"] == "session_not_found"
        assert http.delete(f"/v1/sessions/{sids[0]}", headers=two).status_code == 404
        assert http.post("/v1/completions", json=body, headers=one).status_code == 200
        for sid in sids:
            assert http.delete(f"/v1/sessions/{sid}", headers=one).status_code == 200


def test_session_timeout_must_be_finite(http: Any) -> None:
    for raw in ('{"timeout_s": Infinity}', '{"timeout_s": -1}', '{"timeout_s": NaN}'):
        refused = http.post("/v1/sessions", content=raw,
                            headers={"content-type": "application/json"})
        assert refused.status_code == 400, raw
        assert "timeout_s must be a finite number of seconds > 0" in \
            refused.json()["error"]["message"]


def test_health_answers_while_a_session_call_waits_on_a_long_step(
    served: Callable[..., AbstractContextManager[BackgroundServer]]
) -> None:
    """A session call waits for the engine thread between steps; the event loop keeps
    answering meanwhile (it used to block on the engine's future)."""
    import threading
    import time

    import httpx

    with served(cache="streaming_session") as server:
        release = threading.Event()

        def slow_step(engine: Any) -> None:  # a long step, on the engine thread
            release.wait(10)

        server.engine_loop._commands.put(("call", (slow_step, _done_future())))
        server.engine_loop._wake.set()
        result: dict[str, Any] = {}

        def open_session() -> None:
            result["opened"] = httpx.post(server.url + "/v1/sessions", timeout=30)

        opener = threading.Thread(target=open_session)
        opener.start()
        time.sleep(0.3)  # the session call now waits behind the long step
        worst = 0.0
        for _ in range(5):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t0)
        assert "opened" not in result
        release.set()
        opener.join(30)
        assert result["opened"].status_code == 200
        assert worst < 0.5, worst  # bounded by the loop, not by the 10 s step
        httpx.delete(server.url + f"/v1/sessions/{result['opened'].json()['id']}", timeout=30)


def _done_future() -> Any:
    import concurrent.futures

    return concurrent.futures.Future()
