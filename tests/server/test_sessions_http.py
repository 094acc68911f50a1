"""Streaming sessions over HTTP: open, turns (completions with session_id, through the
official openai client's extra_body), rewind, errors, close; memory whole at idle."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import openai

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
