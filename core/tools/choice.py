"""`tool_choice` "required" or a named function: the answer is forced through the grammar
backend, from the functions' parameter schemas, and read back as tool calls.

- a named function: the output is that function's arguments, a JSON object matching its
  `parameters` schema;
- "required": the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`,
  each item matching one of the tools (vLLM's format).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from plugserve.tools.base import ToolCall

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool.get("function", {}).get("parameters")
    return dict(params) if isinstance(params, Mapping) and params else dict(_ANY_OBJECT)


def named_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    return parameters_schema(tool)


def required_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    items = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "parameters": parameters_schema(t)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    return {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else
            {"anyOf": items}}


def named_calls(name: str, text: str) -> list[ToolCall]:
    return [ToolCall(name, text.strip())]


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer; None when it is not a complete array (cut short)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    return [ToolCall(str(item["name"]), json.dumps(item["parameters"], ensure_ascii=False))
            for item in items if isinstance(item, dict) and "name" in item]
