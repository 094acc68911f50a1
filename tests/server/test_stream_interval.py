"""Streamed chunks of several tokens (vLLM's `--stream-interval` and its request field
`stream_interval`): the first tokens and the last chunk go at once, the others every N new
tokens; the text, token ids and logprobs are those of an unchunked stream. A request that does
not stream gets no token event before its final one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.server.background import BackgroundServer
from plugserve.server.engine_loop import EngineLoop
from plugserve.server.jobs import FINAL_ONLY, Event
from plugserve.server.settings import ServerSettings
from plugserve.testing.memory import assert_memory_whole

CHECKED = {"mem_check": 1, "check_pages": True}  # the invariant checker, physical pages too
PROMPT = "Once upon a time"
TOKENS = 11


@pytest.fixture(scope="module", params=["thread", "process"])
def engine_mode(request: pytest.FixtureRequest) -> str:
    """These tests cross the engine boundary: both modes (tests/server/conftest.py)."""
    return str(request.param)


def reference(server: BackgroundServer) -> Any:
    sp = SamplingParams(max_new_tokens=TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    return server.engine_loop.call_method("generate", [PROMPT], sp)[0]


def streamed(server: BackgroundServer, **body: Any) -> list[Any]:
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = str(server.app.state.server.model_id)
    return list(oa.completions.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **body}))


def assert_chunks(chunks: list[Any], ref: Any, sizes: list[int]) -> None:
    assert [len(c.choices[0].model_extra["token_ids"]) for c in chunks] == sizes
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ref.token_ids
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(ref.logprobs, abs=1e-4)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(sizes) - 1) + ["length"]


@pytest.mark.parametrize(("server_interval", "request_interval", "sizes"), [
    (4, None, [1, 4, 4, 2]),  # the server's interval
    (1, 3, [1, 3, 3, 3, 1]),  # a request raises it
    (4, 2, [1, 4, 4, 2]),  # but cannot lower it
])
def test_chunks_of_the_interval(served: Any, server_interval: int,
                                request_interval: int | None, sizes: list[int]) -> None:
    body = {} if request_interval is None else {"stream_interval": request_interval}
    with served(ServerSettings(stream_interval=server_interval)) as server:
        assert_chunks(streamed(server, **body), reference(server), sizes)


@pytest.mark.parametrize("value", [0, -2, "4", 1.5])
def test_a_bad_interval_is_a_400(server: BackgroundServer, value: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_interval": value}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "stream_interval" in response.text


def test_the_server_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        ServerSettings(stream_interval=0)


def events_of(tiny_model_dir: Path, stream_interval: int, overlap: bool) -> list[Event]:
    """A request's events straight from the engine loop, with this interval."""
    engine = Engine(model=str(tiny_model_dir), overlap=overlap, **CHECKED)
    loop = EngineLoop(engine, max_waiting=8)
    try:
        loop.start()

        async def run() -> list[Event]:
            sp = SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            job = loop.submit([[5, 17, 42, 99]], sp, 0.0, stream_interval=stream_interval)
            events = [await job.next_event()]
            while events[-1].kind != "final":
                events.append(await job.next_event())
            return events

        events = asyncio.run(run())
        loop.stop()
        assert loop.failure is None
        assert_memory_whole(engine)
    finally:
        if loop.alive:
            loop.stop()
        engine.close()
    return events


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_does_not_stream_gets_its_final_event_only(tiny_model_dir: Path,
                                                                  overlap: bool) -> None:
    every = events_of(tiny_model_dir, 1, overlap)
    three = events_of(tiny_model_dir, 3, overlap)
    final_only = events_of(tiny_model_dir, FINAL_ONLY, overlap)
    assert [e.kind for e in every] == ["accepted"] + ["tokens"] * (len(every) - 2) + ["final"]
    assert [e.kind for e in final_only] == ["accepted", "final"]
    assert final_only[-1].token_ids == [t for e in every for t in e.token_ids]
    assert len(final_only[-1].token_ids) == TOKENS
    # Every third token after the first: what is left of the 11 comes with the final event.
    assert [len(e.token_ids) for e in three[1:]] == [1, 3, 3, 3, 1]
    assert [t for e in three for t in e.token_ids] == final_only[-1].token_ids
