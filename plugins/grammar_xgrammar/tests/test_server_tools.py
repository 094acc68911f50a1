"""Tool calls through the official openai client: `required` and a named function are forced
by the grammar from the functions' parameter schemas (valid arguments from a random model);
`auto` reads Hermes `<tool_call>` blocks (here the output is forced into one with a regex, the
only way a random model writes one), full and streamed as deltas; a conversation carrying an
assistant's tool_calls and a tool's answer is accepted."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])


def call(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any
         ) -> tuple[str | None, list[dict[str, Any]], str]:
    """(content, tool calls as dicts, finish_reason), the stream's deltas put together."""
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS,
                            "max_tokens": 120, "temperature": 1.0, **kwargs}
    if not stream:
        out = client.chat.completions.create(**args).choices[0]
        calls = [c.model_dump() for c in out.message.tool_calls or ()]
        return out.message.content, calls, str(out.finish_reason)
    content, reason = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": delta.id, "type": delta.type,
                                                       "function": {"name": "",
                                                                    "arguments": ""}})
                if delta.function is not None:
                    entry["function"]["name"] += delta.function.name or ""
                    entry["function"]["arguments"] += delta.function.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)], reason


def check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["function"]["arguments"]),
                            SCHEMA_OF[c["function"]["name"]])


@STREAM
def test_named_function(client: openai.OpenAI, model: str, stream: bool) -> None:
    for seed in range(3):
        content, calls, reason = call(client, model, stream, seed=seed, tool_choice={
            "type": "function", "function": {"name": "get_weather"}})
        assert reason == "stop" and not content
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        check_calls(calls)


@STREAM
def test_required(client: openai.OpenAI, model: str, stream: bool) -> None:
    for seed in range(3):
        content, calls, reason = call(client, model, stream, seed=seed, tool_choice="required",
                                      max_tokens=300)
        assert reason == "tool_calls" and not content, (content, reason)
        check_calls(calls)


HERMES = (r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>')


@STREAM
def test_auto_parses_hermes_tool_calls(client: openai.OpenAI, model: str,
                                       stream: bool) -> None:
    for seed in range(2):
        content, calls, reason = call(client, model, stream, seed=seed, tool_choice="auto",
                                      extra_body={"structured_outputs": {"regex": HERMES}})
        assert content == "Let me check. " and reason == "tool_calls"
        check_calls(calls)
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


@STREAM
def test_auto_without_a_call_is_content(client: openai.OpenAI, model: str,
                                        stream: bool) -> None:
    content, calls, reason = call(client, model, stream, seed=0, extra_body={
        "structured_outputs": {"regex": r"No tools <needed>, sorry\."}})
    assert (content, calls, reason) == ("No tools <needed>, sorry.", [], "stop")


def test_tool_choice_none_returns_text(client: openai.OpenAI, model: str) -> None:
    content, calls, reason = call(client, model, False, tool_choice="none", max_tokens=8)
    assert calls == [] and reason == "length" and content


def test_conversation_with_tool_results(client: openai.OpenAI, model: str) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                         tool_choice="none", max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    # The template rendered the tools, the call and the result: a longer prompt than without.
    bare = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 40
    assert re.search("sunny", json.dumps(messages))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, model: str, kwargs: dict[str, Any],
                                   words: str) -> None:
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS,
                            "max_tokens": 4, **kwargs}
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert words in str(info.value), str(info.value)
