"""The Hermes tool-call parser and the streamed tool-call deltas: full and partial text, a
tag split across chunks held back, a broken block left as content; the registry lists the
built-in parser and `plugserve plugins` the grammar and tool-parser kinds."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from plugserve.cli import app
from plugserve.plugins import get_plugin_host
from plugserve.server.tool_output import ToolAnswer, ToolMode
from plugserve.tools.choice import required_calls, required_schema
from plugserve.tools.hermes import HermesToolParser

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_full_answers() -> None:
    parser = HermesToolParser([])
    assert parser.parse("plain text") == ("plain text", [])
    content, calls = parser.parse("Sure. " + CALL + "\n" + CALL.replace('"f"', '"g"'))
    assert content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                 ("g", {"x": 1})]
    assert parser.parse(CALL)[0] is None
    broken = "x <tool_call>{not json}</tool_call>"
    assert parser.parse(broken) == (broken, [])


def test_streamed_deltas_add_up() -> None:
    answer = ToolAnswer(ToolMode("auto", HermesToolParser, []))
    text = "Let me see. " + CALL
    content, calls = "", []
    for end in range(1, len(text) + 1):
        delta, new, reason = answer.stream(text[:end], None)
        assert "<" not in delta, "a possible tag start was sent as content"
        content += delta
        calls += new
        assert reason is None
    delta, new, reason = answer.stream(text, "stop")
    content += delta
    calls += new
    assert content == "Let me see. " and reason == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_a_lone_angle_bracket_is_content_in_the_end() -> None:
    answer = ToolAnswer(ToolMode("auto", HermesToolParser, []))
    assert answer.stream("a <tool", None)[0] == "a "
    assert answer.stream("a <tools>", "stop") == ("<tools>", [], "stop")


def test_required_format() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    schema = required_schema(tools)
    assert schema["minItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["f"]
    calls = required_calls('[{"name": "f", "parameters": {"a": 2}}]')
    assert calls is not None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 2}')]
    assert required_calls('[{"name": "f", "param') is None
    answer = ToolAnswer(ToolMode("required", None, tools))
    assert answer.full('[{"name": "f", "param', "length")[2] == "length"


def test_registries_and_listing() -> None:
    registries = get_plugin_host().registries
    assert "hermes" in registries.tool_parsers
    assert registries.tool_parsers.get("hermes").load() is HermesToolParser
    out = CliRunner().invoke(app, ["plugins"]).output
    assert "tool parser" in out and "hermes" in out
