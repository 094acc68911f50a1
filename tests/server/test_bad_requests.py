"""Bad requests: each gets its 4xx and an OpenAI-shaped error that says what was wrong, never a
traceback, and the server keeps serving (a good request right after each is answered)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from plugserve.server.background import BackgroundServer
from plugserve.server.settings import ServerSettings

C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "Hi"}]

# (name, method, path, body: dict = JSON, str = raw text, status, words in the message, param)
CASES: list[tuple[str, str, str, Any, int, str, str | None]] = [
    ("malformed JSON", "POST", C, '{"prompt": "x", ', 400, "malformed JSON body", None),
    ("body not an object", "POST", C, "[1, 2]", 400, "valid dictionary", None),
    ("NaN literal temperature", "POST", C, '{"prompt": "x", "temperature": NaN}', 400,
     "temperature must be 0 (greedy) or a finite number", "temperature"),
    ("missing prompt", "POST", C, {"max_tokens": 3}, 400, "prompt: field required", "prompt"),
    ("missing messages", "POST", CHAT, {"max_tokens": 3}, 400, "messages: field required",
     "messages"),
    ("prompt of wrong type", "POST", C, {"prompt": 5}, 400, "prompt must be a string", "prompt"),
    ("mixed prompt list", "POST", C, {"prompt": ["a", 1]}, 400, "not a mix", "prompt"),
    ("empty prompt list", "POST", C, {"prompt": []}, 400, "empty list", "prompt"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "prompt is empty", "prompt"),
    ("negative max_tokens", "POST", C, {"prompt": "x", "max_tokens": -1}, 400,
     "max_tokens must be at least 0", "max_tokens"),
    ("max_tokens 0 without echo", "POST", C, {"prompt": "x", "max_tokens": 0}, 400,
     "max_tokens: 0 needs echo=true", "max_tokens"),
    ("max_tokens past the context", "POST", C, {"prompt": [5, 6, 7], "max_tokens": 10**12},
     400, "max_tokens is 1000000000000 but the prompt has 3 tokens and the context holds 512: "
     "at most 509", "max_tokens"),
    ("chat max_tokens past the context", "POST", CHAT, {"messages": MSG, "max_tokens": 600},
     400, "but the prompt has", "max_tokens"),
    ("lone surrogate in the prompt", "POST", C, '{"prompt": "ab\\udcff"}', 400,
     "prompt: text is not valid Unicode (a lone surrogate at character 2)", "prompt"),
    ("lone surrogate in a message", "POST", CHAT,
     '{"messages": [{"role": "user", "content": "\\ud800x"}]}', 400,
     "messages.0.content: text is not valid Unicode", "messages"),
    ("lone surrogate in a stop string", "POST", C, '{"prompt": "x", "stop": ["\\udfff"]}',
     400, "stop.0: text is not valid Unicode", "stop"),
    ("repetition_penalty 0", "POST", C, {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty must be a finite number > 0", "repetition_penalty"),
    ("presence_penalty 3", "POST", C, {"prompt": "x", "presence_penalty": 3}, 400,
     "presence_penalty must be a number in [-2, 2]", "presence_penalty"),
    ("logit_bias key not an id", "POST", C, {"prompt": "x", "logit_bias": {"a": 1}}, 400,
     "logit_bias keys must be token ids", "logit_bias"),
    ("logit_bias outside the vocabulary", "POST", C, {"prompt": "x",
                                                      "logit_bias": {"99999": 1}},
     400, "logit_bias has token ids outside the vocabulary", "logit_bias"),
    ("min_tokens over max_tokens", "POST", C, {"prompt": "x", "max_tokens": 2,
                                               "min_tokens": 5}, 400,
     "min_tokens (5) must not exceed", "min_tokens"),
    ("stop_token_ids outside the vocabulary", "POST", C, {"prompt": "x",
                                                          "stop_token_ids": [99999]},
     400, "unknown stop token id", "stop_token_ids"),
    ("max_tokens as text", "POST", C, {"prompt": "x", "max_tokens": "5"}, 400,
     "max_tokens: Input should be a valid integer", "max_tokens"),
    ("negative temperature", "POST", C, {"prompt": "x", "temperature": -1}, 400,
     "temperature must be 0", "temperature"),
    ("temperature as bool", "POST", C, {"prompt": "x", "temperature": True}, 400,
     "temperature: Input should be a valid number", "temperature"),
    ("top_p 0", "POST", C, {"prompt": "x", "top_p": 0}, 400, "top_p must be a finite number in "
     "(0, 1], got 0", "top_p"),
    ("top_k 0", "POST", C, {"prompt": "x", "top_k": 0}, 400, "top_k must be -1", "top_k"),
    ("seed as float", "POST", C, {"prompt": "x", "seed": 1.5}, 400, "seed", "seed"),
    ("n=0", "POST", C, {"prompt": "x", "n": 0}, 400, "n must be at least 1, got 0", "n"),
    ("n over --max-n", "POST", C, {"prompt": "x", "n": 17}, 400,
     "n is 17; this server allows at most 16 samples per prompt (--max-n)", "n"),
    ("best_of below n", "POST", C, {"prompt": "x", "n": 3, "best_of": 2}, 400,
     "best_of must be at least n (3), got 2", None),
    ("best_of over --max-n", "POST", C, {"prompt": "x", "best_of": 20}, 400,
     "best_of is 20; this server allows at most 16", "best_of"),
    ("streamed best_of > n", "POST", C, {"prompt": "x", "best_of": 2, "stream": True}, 400,
     "best_of (2) > n (1) cannot be streamed", "best_of"),
    ("logprobs over the limit", "POST", C, {"prompt": "x", "logprobs": 21}, 400,
     "logprobs must be in [0, 20] (--max-logprobs), got 21", "logprobs"),
    ("prompt_logprobs over the limit", "POST", C, {"prompt": "x", "prompt_logprobs": 50}, 400,
     "prompt_logprobs must be in [0, 20]", "prompt_logprobs"),
    ("empty stop string", "POST", C, {"prompt": "x", "stop": [""]}, 400,
     "stop strings must not be empty", "stop"),
    ("unknown field", "POST", C, {"prompt": "x", "sesion_id": 3}, 400,
     "sesion_id: unknown field", "sesion_id"),
    ("stream as text", "POST", C, {"prompt": "x", "stream": "yes"}, 400, "stream", "stream"),
    ("token id outside the vocabulary", "POST", C, {"prompt": [1, 999999]}, 400,
     "outside the vocabulary", "prompt"),
    ("prompt over the context", "POST", C, {"prompt": [7] * 600}, 413,
     "prompt has 600 tokens; the context holds 512", "prompt"),
    ("chat over the context", "POST", CHAT,
     {"messages": [{"role": "user", "content": "y" * 700}]}, 413, "the context holds 512",
     "prompt"),
    ("unknown model", "POST", C, {"model": "gpt-9", "prompt": "x"}, 404,
     "model 'gpt-9' does not exist", "model"),
    ("unknown model id", "GET", "/v1/models/gpt-9", None, 404, "does not exist", "model"),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, 404, "no route POST", None),
    ("wrong method", "GET", C, None, 405, "method GET is not allowed", None),
    ("chat with a bad role", "POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role", "messages"),
    ("chat with an image", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content",
     "messages"),
    ("chat without messages", "POST", CHAT, {"messages": []}, 400, "at least one message",
     "messages"),
    ("chat top_logprobs without logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 3},
     400, "top_logprobs: needs logprobs=true", "top_logprobs"),
    ("chat top_logprobs over the limit", "POST", CHAT, {"messages": MSG, "logprobs": True,
                                                       "top_logprobs": 30},
     400, "top_logprobs must be in [0, 20]", "top_logprobs"),
    ("huge body", "POST", C, {"prompt": "x" * (100 << 10)}, 413, "larger than the server's "
     "limit of 65,536 bytes", None),
]


def send(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if body is None:
        return http.request(method, path)
    if isinstance(body, str):
        return http.request(method, path, content=body,
                            headers={"content-type": "application/json"})
    return http.request(method, path, json=body)


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "words", "param"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_request_then_good(http: httpx.Client, name: str, method: str, path: str,
                               body: Any, status: int, words: str, param: str | None) -> None:
    response = send(http, method, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    assert error["param"] == param
    assert "Traceback" not in response.text and 'File "' not in response.text
    good = http.post(C, json=GOOD)
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] >= 1


def test_huge_chunked_body(http: httpx.Client) -> None:
    """A body with no Content-Length is counted as it arrives."""
    payload = json.dumps({"prompt": "x" * (200 << 10)}).encode()
    chunks = (payload[i:i + 8192] for i in range(0, len(payload), 8192))
    response = http.post(C, content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert "larger than the server's limit" in response.json()["error"]["message"]
    assert http.post(C, json=GOOD).status_code == 200


def test_rejections_counted(http: httpx.Client) -> None:
    http.post(C, json={"prompt": "x", "n": 0})
    text = http.get("/metrics").text
    assert 'plugserve_http_errors_total{status="400",type="invalid_request_error"}' in text
    assert 'plugserve_requests_total{outcome="rejected"}' in text


def test_api_key(served: Any) -> None:
    import openai

    with served(ServerSettings(api_key="sekret")) as server:
        assert isinstance(server, BackgroundServer)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            missing = http.post(C, json=GOOD)
            assert missing.status_code == 401
            assert missing.headers["www-authenticate"] == "Bearer"
            assert "missing API key" in missing.json()["error"]["message"]
            wrong = http.post(C, json=GOOD, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert wrong.json()["error"]["code"] == "invalid_api_key"
            # Refused before the body is read: a malformed body still gets the 401.
            bad = http.post(C, content="{", headers={"content-type": "application/json"})
            assert bad.status_code == 401
            assert http.get("/health").status_code == 200  # probes need no key
            assert http.get("/metrics").status_code == 200
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert oa.completions.create(model=server.app.state.server.model_id, prompt="Hi",
                                     max_tokens=2).usage is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0
                          ).models.list()


def test_several_keys_and_any_case_scheme(served: Any) -> None:
    with served(ServerSettings(api_key="alpha, beta")) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        for header in ("Bearer alpha", "bearer beta", "BEARER  alpha"):
            ok = http.post(C, json=GOOD, headers={"Authorization": header})
            assert ok.status_code == 200, (header, ok.text)
        for header in ("Basic alpha", "Bearer alpha, beta", "alpha"):
            assert http.post(C, json=GOOD, headers={"Authorization": header}
                             ).status_code == 401, header
        tokenize = http.post("/tokenize", json={"prompt": "x"})
        assert tokenize.status_code == 401  # the tokenizer routes are guarded too
