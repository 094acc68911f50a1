"""response_format and structured_outputs through the official openai client, on chat and
completions, streaming and not: every output of the random model is valid for its constraint
and ends with finish_reason "stop"; an invalid schema, regex or grammar is a 400 naming the
field."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from plugserve.testing.conformance.grammar.languages import SCHEMAS

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])


def chat(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    args: dict[str, Any] = {"model": model, "max_tokens": 200, "temperature": 1.0,
                            "messages": [{"role": "user", "content": "Answer."}], **kwargs}
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content or "", str(out.choices[0].finish_reason)
    text, reason = "", ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def completion(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any
               ) -> tuple[str, str]:
    args: dict[str, Any] = {"model": model, "prompt": "Answer:", "max_tokens": 200,
                            "temperature": 1.0, **kwargs}
    if not stream:
        out = client.completions.create(**args)
        return out.choices[0].text, str(out.choices[0].finish_reason)
    text, reason = "", ""
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


@STREAM
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_chat_json_schema(client: openai.OpenAI, model: str, stream: bool, index: int) -> None:
    schema = SCHEMAS[index]
    for seed in range(3):
        text, reason = chat(client, model, stream, seed=seed, response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@STREAM
def test_completions_json_schema(client: openai.OpenAI, model: str, stream: bool) -> None:
    schema = SCHEMAS[1]
    text, reason = completion(client, model, stream, seed=4, extra_body={
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": schema}}})
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


@STREAM
def test_regex_choice_and_grammar(client: openai.OpenAI, model: str, stream: bool) -> None:
    for seed in range(3):
        text, reason = chat(client, model, stream, seed=seed,
                            extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2}-\d{3}"}})
        assert reason == "stop" and re.fullmatch(r"[A-Z][a-z]{2}-\d{3}", text), text
        text, reason = completion(client, model, stream, seed=seed, extra_body={
            "structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert reason == "stop" and text in ("red", "green", "blue"), text
        text, reason = completion(client, model, stream, seed=seed, extra_body={
            "structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "."'}})
        assert reason == "stop" and re.fullmatch(r"(ab|cd)+\.", text), text


def test_json_object(client: openai.OpenAI, model: str) -> None:
    # Any object: a random model may not close it within the budget; whatever it wrote is an
    # object's beginning, and when it stopped, a whole object.
    for seed in range(3):
        text, reason = chat(client, model, False, seed=seed, max_tokens=40,
                            response_format={"type": "json_object"})
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "ebnf"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
])
def test_invalid_constraints_are_400(client: openai.OpenAI, model: str, body: dict[str, Any],
                                     field: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=body)
    message = str(info.value)
    assert field in message and words in message, message
