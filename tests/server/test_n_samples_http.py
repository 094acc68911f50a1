"""n > 1 and best_of through the official `openai` client, streamed and not: choice indices
(prompt_i * n + j), each choice's own finish_reason, usage counting the prompt once, seeded
samples reproducible, best_of by cumulative logprob; the memory whole after each (checker at
level 1 with page checks in the server's engine)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from plugserve.sampling import SamplingParams
from plugserve.server.background import BackgroundServer
from tests.server.conftest import wait_idle

PROMPTS = ["The capital of France is", "Once upon a time"]



@pytest.fixture(scope="module", params=["thread", "process"])
def engine_mode(request: pytest.FixtureRequest) -> str:
    """These tests cross the engine boundary: both modes (tests/server/conftest.py)."""
    return str(request.param)

def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_id(server: BackgroundServer) -> str:
    return str(server.app.state.server.model_id)


def greedy(server: BackgroundServer, prompt: str, max_tokens: int, chat: bool = False) -> Any:
    sp = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    return server.engine_loop.call_method("generate", [prompt], sp, chat=chat)[0]


def test_completions_n_per_prompt(server: BackgroundServer) -> None:
    refs = [greedy(server, p, 6) for p in PROMPTS]
    out = client(server).completions.create(
        model=model_id(server), prompt=PROMPTS, max_tokens=6, temperature=0, n=3,
        extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        assert c.text == refs[c.index // 3].text
        assert c.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(r.prompt_tokens for r in refs)  # once per prompt
    assert out.usage.completion_tokens == 6 * 6


def test_seeded_samples_differ_and_repeat(server: BackgroundServer) -> None:
    def ask() -> list[str]:
        out = client(server).completions.create(
            model=model_id(server), prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7,
            n=4, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) == 4
    assert ask() == first


def test_stream_n_each_choice_ends_on_its_own(server: BackgroundServer) -> None:
    full = client(server).completions.create(
        model=model_id(server), prompt=PROMPTS, max_tokens=7, temperature=1.0, seed=3, n=2,
        extra_body={"ignore_eos": True})
    chunks = list(client(server).completions.create(
        model=model_id(server), prompt=PROMPTS, max_tokens=7, temperature=1.0, seed=3, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}
    assert texts == {c.index: c.text for c in full.choices}
    usage = chunks[-1].usage
    assert usage is not None and full.usage is not None
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == 4 * 7


def test_stream_done_once(server: BackgroundServer) -> None:
    body = {"model": model_id(server), "prompt": PROMPTS[1], "max_tokens": 4, "n": 3,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        lines = http.post("/v1/completions", json=body).text.splitlines()
    data = [line for line in lines if line.startswith("data: ")]
    assert data.count("data: [DONE]") == 1 and data[-1] == "data: [DONE]"


def test_chat_n_streamed_and_not(server: BackgroundServer) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    ref = greedy(server, "Say something.", 5, chat=True)
    out = client(server).chat.completions.create(
        model=model_id(server), messages=messages, max_tokens=5, temperature=0, n=2,
        extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [ref.text, ref.text]
    assert out.usage is not None and out.usage.prompt_tokens == ref.prompt_tokens
    stream = client(server).chat.completions.create(
        model=model_id(server), messages=messages, max_tokens=5, temperature=0, n=2,
        stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    ends: list[int] = []
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                ends.append(c.index)
    assert texts == {0: ref.text, 1: ref.text}
    assert sorted(ends) == [0, 1]


def test_best_of_is_the_highest_cumulative_logprob(server: BackgroundServer) -> None:
    common: dict[str, Any] = {"model": model_id(server), "prompt": PROMPTS[0],
                              "max_tokens": 6, "temperature": 1.0, "seed": 11,
                              "extra_body": {"ignore_eos": True}}
    every = client(server).completions.create(n=4, logprobs=0, **common)
    scored = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))  # type: ignore[union-attr]
    best = client(server).completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == [c.text for c in scored[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage is not None and every.usage is not None
    assert best.usage.prompt_tokens == every.usage.prompt_tokens
    assert best.usage.completion_tokens == 2 * 6


def test_echo_with_n_gives_every_choice_the_prompt_logprobs(server: BackgroundServer) -> None:
    out = client(server).completions.create(
        model=model_id(server), prompt=PROMPTS[1], max_tokens=3, temperature=0, n=2, echo=True,
        logprobs=1)
    first, second = out.choices
    assert first.text == second.text and first.text.startswith(PROMPTS[1])
    assert first.logprobs is not None and second.logprobs is not None
    assert first.logprobs.text_offset == second.logprobs.text_offset
    prompt_len = sum(1 for at in first.logprobs.text_offset if at < len(PROMPTS[1]))
    ones, twos = first.logprobs.token_logprobs, second.logprobs.token_logprobs
    assert ones[:prompt_len] == twos[:prompt_len]  # the prompt's: the parent's, shared
    assert ones[0] is None and all(v is not None for v in ones[1:] + twos[1:])
    # The sampled tokens' logprobs come from each sample's own forward (the fork computes its
    # last prompt token in a step of its own, where other kernels may add in another order).
    assert ones[prompt_len:] == pytest.approx(twos[prompt_len:], abs=1e-4)


def test_stream_closed_mid_way_aborts_every_sample(server: BackgroundServer) -> None:
    stream = client(server).completions.create(
        model=model_id(server), prompt=PROMPTS, max_tokens=200, temperature=1.0, n=3,
        stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if len(seen) == 6:
            break
    stream.close()
    wait_idle(server)  # every sample aborted, the memory whole (checked on the engine thread)
