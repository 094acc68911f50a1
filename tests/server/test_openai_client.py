"""The official `openai` client, sync and async, streaming and not, against a live server: the
tokens, text, logprobs and usage equal `Engine.generate` for the same greedy request, on the
same engine (run on its own thread between requests)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from plugserve.sampling import SamplingParams
from plugserve.server.background import BackgroundServer

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
TOKEN_PROMPT = [5, 17, 42, 99, 3, 250, 7]



@pytest.fixture(scope="module", params=["thread", "process"])
def engine_mode(request: pytest.FixtureRequest) -> str:
    """These tests cross the engine boundary: both modes (tests/server/conftest.py)."""
    return str(request.param)

def reference(server: BackgroundServer, prompt: str | list[int], max_tokens: int, *,
              chat: bool = False, stop: tuple[str, ...] = (), ignore_eos: bool = False) -> Any:
    """`Engine.generate` on the server's own engine, on the engine thread."""
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, logprobs=True, stop=stop,
                        ignore_eos=ignore_eos)
    return server.engine_loop.call_method("generate", [prompt], sp, chat=chat)[0]


def model_id(server: BackgroundServer) -> str:
    return str(server.app.state.server.model_id)


def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def extra(obj: Any, name: str) -> Any:
    return obj.model_extra[name]


@pytest.mark.parametrize("prompt", [*PROMPTS, TOKEN_PROMPT])
def test_completion_equals_generate(server: BackgroundServer, prompt: Any) -> None:
    ref = reference(server, prompt, 12)
    out = client(server).completions.create(
        model=model_id(server), prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert extra(choice, "token_ids") == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert out.usage is not None
    assert out.usage.prompt_tokens == ref.prompt_tokens
    assert out.usage.completion_tokens == ref.output_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == ref.prompt_tokens + ref.output_tokens


def test_stream_equals_generate(server: BackgroundServer) -> None:
    prompt = PROMPTS[1]
    ref = reference(server, prompt, 16, ignore_eos=True)
    chunks = list(client(server).completions.create(
        model=model_id(server), prompt=prompt, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ))
    body, last = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in body) == ref.text
    assert [t for c in body for t in extra(c.choices[0], "token_ids")] == ref.token_ids
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 16 == ref.output_tokens
    assert last.usage.prompt_tokens == ref.prompt_tokens


def test_several_prompts_in_one_request(server: BackgroundServer) -> None:
    refs = [reference(server, p, 8) for p in PROMPTS]
    out = client(server).completions.create(model=model_id(server), prompt=PROMPTS,
                                            max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(r.output_tokens for r in refs)
    assert out.usage.prompt_tokens == sum(r.prompt_tokens for r in refs)


def test_chat_equals_generate(server: BackgroundServer) -> None:
    question = "What is two plus two?"
    ref = reference(server, question, 10, chat=True)
    oa = client(server)
    messages: Any = [{"role": "user", "content": question}]
    out = oa.chat.completions.create(model=model_id(server), messages=messages, max_tokens=10,
                                     temperature=0, logprobs=True,
                                     extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert extra(choice, "token_ids") == ref.token_ids
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-4)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.prompt_tokens,
                                                                      ref.output_tokens)
    stream = oa.chat.completions.create(model=model_id(server), messages=messages,
                                        max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == ref.output_tokens


def test_stop_strings_honoured(server: BackgroundServer) -> None:
    prompt = PROMPTS[0]
    full = reference(server, prompt, 24, ignore_eos=True).text
    # A stop string from the middle of the greedy text, made of printable characters.
    start = next(i for i in range(3, len(full) - 2) if full[i:i + 2].isprintable()
                 and "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    ref = reference(server, prompt, 24, stop=(stop,), ignore_eos=True)
    assert ref.finish_reason == "stop" and stop not in ref.text
    assert ref.text == full[: full.index(stop)]
    oa = client(server)
    out = oa.completions.create(model=model_id(server), prompt=prompt, max_tokens=24,
                                temperature=0, stop=[stop, "never-seen"],
                                extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "stop"
    streamed = oa.completions.create(model=model_id(server), prompt=prompt, max_tokens=24,
                                     temperature=0, stop=stop, stream=True,
                                     extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_async_client(server: BackgroundServer) -> None:
    refs = [reference(server, p, 10) for p in PROMPTS]

    async def main() -> tuple[list[str], list[str]]:
        oa = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def plain(p: str) -> str:
            out = await oa.completions.create(model=model_id(server), prompt=p, max_tokens=10,
                                              temperature=0)
            return out.choices[0].text

        async def streamed(p: str) -> str:
            stream = await oa.completions.create(model=model_id(server), prompt=p,
                                                 max_tokens=10, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        # All at once: the engine batches them; each answer is still its own.
        texts = await asyncio.gather(*(plain(p) for p in PROMPTS))
        streams = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        await oa.close()
        return list(texts), list(streams)

    texts, streams = asyncio.run(main())
    assert texts == [r.text for r in refs]
    assert streams == [r.text for r in refs]


def test_seeded_sampling_is_reproducible(server: BackgroundServer) -> None:
    oa = client(server)

    def sample() -> list[int]:
        out = oa.completions.create(model=model_id(server), prompt=PROMPTS[2], max_tokens=8,
                                    temperature=0.8, top_p=0.9, seed=1234,
                                    extra_body={"return_token_ids": True, "top_k": 50})
        return list(extra(out.choices[0], "token_ids"))

    assert sample() == sample()


def test_models_endpoint(server: BackgroundServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [model_id(server)]
    assert client(server).models.retrieve(model_id(server)).id == model_id(server)
