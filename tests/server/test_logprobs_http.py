"""Logprobs through the official `openai` client: completions `logprobs` N with `echo` (also
with `max_tokens=0`), vLLM's `prompt_logprobs`, chat `top_logprobs`, streamed and not; every
value equals the engine's own (`Engine.generate` on the server's engine), which the engine tests
hold against transformers. Then the payloads lm-eval's `local-completions` and vLLM's
`vllm bench serve` send, replayed as they are."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from plugserve.sampling import SamplingParams
from plugserve.server.background import BackgroundServer

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 12]
TOL = 1e-6  # the same engine computes both: equal up to float printing



@pytest.fixture(scope="module", params=["thread", "process"])
def engine_mode(request: pytest.FixtureRequest) -> str:
    """These tests cross the engine boundary: both modes (tests/server/conftest.py)."""
    return str(request.param)

def engine_result(server: BackgroundServer, prompt: list[int], **fields: Any) -> Any:
    sp = SamplingParams(temperature=0.0, **fields)
    return server.engine_loop.call_method("generate", [prompt], sp)[0]


def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_id(server: BackgroundServer) -> str:
    return str(server.app.state.server.model_id)


def token_text(server: BackgroundServer, token: int) -> str:
    return str(server.engine_loop.tokenizer.decode([token], skip_special_tokens=False))


def test_echo_logprobs(server: BackgroundServer) -> None:
    ref = engine_result(server, PROMPT, max_new_tokens=3, ignore_eos=True, logprobs=True,
                        top_logprobs=2, prompt_logprobs=2)
    out = client(server).completions.create(model=model_id(server), prompt=PROMPT,
                                            max_tokens=3, temperature=0, logprobs=2, echo=True,
                                            extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    n = len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs[1:], abs=TOL)
    assert lp.token_logprobs[n:] == pytest.approx(ref.logprobs, abs=TOL)
    assert lp.tokens == [token_text(server, t) for t in PROMPT + ref.token_ids]
    for k in range(1, n):  # the two most likely, plus the prompt's own token
        expected = {token_text(server, t): v for t, v in ref.prompt_top_logprobs[k]}
        expected.setdefault(token_text(server, PROMPT[k]), ref.prompt_logprobs[k])
        assert lp.top_logprobs[k] == pytest.approx(expected, abs=TOL)
    prompt_text = server.engine_loop.tokenizer.decode(PROMPT)
    assert out.choices[0].text == prompt_text + ref.text
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_echo_max_tokens_zero(server: BackgroundServer) -> None:
    """lm-eval's scoring request without a generated token: the prompt and its logprobs."""
    ref = engine_result(server, PROMPT, max_new_tokens=1, logprobs=True, prompt_logprobs=1)
    out = client(server).completions.create(model=model_id(server), prompt=PROMPT,
                                            max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    assert choice.text == server.engine_loop.tokenizer.decode(PROMPT)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(PROMPT)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:],
                                                               abs=TOL)
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert choice.finish_reason == "length"


def test_vllm_prompt_logprobs_and_stream(server: BackgroundServer) -> None:
    ref = engine_result(server, PROMPT, max_new_tokens=4, ignore_eos=True, logprobs=True,
                        top_logprobs=3, prompt_logprobs=3)
    oa = client(server)
    out = oa.completions.create(model=model_id(server), prompt=PROMPT, max_tokens=4,
                                temperature=0, logprobs=3,
                                extra_body={"prompt_logprobs": 3, "ignore_eos": True})
    prompt_lp = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None
    for k in range(1, len(PROMPT)):
        entry = prompt_lp[k][str(PROMPT[k])]
        assert entry["logprob"] == pytest.approx(ref.prompt_logprobs[k], abs=TOL)
        tops = ref.prompt_top_logprobs[k]
        assert [prompt_lp[k][str(t)]["rank"] for t, _ in tops] == [1, 2, 3]
    chunks = list(oa.completions.create(model=model_id(server), prompt=PROMPT, max_tokens=4,
                                        temperature=0, logprobs=3, echo=True, stream=True,
                                        extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text == server.engine_loop.tokenizer.decode(PROMPT)
    assert first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=TOL)
    streamed = [v for c in chunks[1:] for v in (c.choices[0].logprobs.token_logprobs or [])
                if c.choices[0].logprobs is not None]
    assert streamed == pytest.approx(ref.logprobs, abs=TOL)
    assert "".join(c.choices[0].text for c in chunks[1:]) == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs(server: BackgroundServer, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "Count: 1, 2,"}]
    ids = server.engine_loop.tokenizer.apply_chat_template(messages)
    ref = engine_result(server, ids, max_new_tokens=5, ignore_eos=True, logprobs=True,
                        top_logprobs=4)
    oa = client(server)
    kwargs: Any = {"model": model_id(server), "messages": messages, "max_tokens": 5,
                   "temperature": 0, "logprobs": True, "top_logprobs": 4,
                   "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(oa.chat.completions.create(stream=True, **kwargs))
        content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for c in ch.choices[0].logprobs.content or []]
    else:
        out = oa.chat.completions.create(**kwargs)
        assert out.choices[0].logprobs is not None
        content = list(out.choices[0].logprobs.content or [])
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, abs=TOL)
    for item, tops in zip(content, ref.top_logprobs, strict=True):
        assert [t.token for t in item.top_logprobs] == [token_text(server, t) for t, _ in tops]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in tops],
                                                                       abs=TOL)


def test_lm_eval_loglikelihood_payload(server: BackgroundServer) -> None:
    """What lm-eval 0.4's `local-completions` sends for a loglikelihood request (token ids,
    echo, logprobs 1, max_tokens 1, seed), and how it reads the answer: the continuation's
    logprob sum and whether every continuation token was the greedy one."""
    context, continuation = PROMPT[:6], PROMPT[6:]
    payload = {"model": model_id(server), "prompt": [context + continuation],
               "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    answer = httpx.post(server.url + "/v1/completions", json=payload, timeout=60).json()
    choice = answer["choices"][0]
    ref = engine_result(server, context + continuation, max_new_tokens=1, prompt_logprobs=1)
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    assert sum(token_logprobs) == pytest.approx(sum(ref.prompt_logprobs[ctxlen:]), abs=1e-5)
    is_greedy = all(tok == max(top.values()) for tok, top in zip(
        token_logprobs, choice["logprobs"]["top_logprobs"][ctxlen:-1], strict=True))
    greedy_ref = all(top[0][0] == continuation[k] for k, top in
                     enumerate(ref.prompt_top_logprobs[ctxlen:]))
    assert is_greedy == greedy_ref


def test_vllm_bench_payloads(server: BackgroundServer) -> None:
    """The bodies `vllm bench serve` (0.32) sends with its openai and openai-chat backends,
    as they are: repetition_penalty 1.0, logprobs null, ignore_eos, stream_options, content as
    a list of text parts, max_completion_tokens."""
    completion = {"model": model_id(server), "prompt": "Tell me a story", "repetition_penalty":
                  1.0, "max_tokens": 8, "logprobs": None, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = {"model": model_id(server), "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me a story"}]}], "max_completion_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            lines = [ln for ln in response.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        import json

        last = json.loads(lines[-2][6:])
        assert last["usage"]["completion_tokens"] == 8


def test_tokenize_detokenize(server: BackgroundServer) -> None:
    tok = server.engine_loop.tokenizer
    out = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world",
                                                     "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server.engine_loop.context_len
    assert "".join(out["token_strs"]) .replace("<s>", "") != ""
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages)
    back = httpx.post(server.url + "/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == tok.decode(out["tokens"])
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
