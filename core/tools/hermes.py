"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The content is the text before the first `<tool_call>`. A block whose JSON does not parse, or
names no function, is not a tool call: then the whole answer is content (as vLLM's parser).
"""

from __future__ import annotations

import json
import re

from plugserve.tools.base import ToolCall, ToolParser, ToolStreamState

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return ToolCall(obj["name"], text)


class HermesToolParser(ToolParser):
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls = [_call(block) for block in _BLOCK.findall(text)]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:start]  # as streamed: what came before the first call, unchanged
        return content if content.strip() else None, [c for c in calls if c is not None]

    def parse_partial(self, text: str) -> ToolStreamState:
        start = text.find(OPEN)
        if start < 0:
            # Hold back a tail that may be the start of "<tool_call>".
            hold = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1)
                         if OPEN.startswith(text[-n:])), 0)
            return ToolStreamState(text[: len(text) - hold], [])
        calls = [_call(block) for block in _BLOCK.findall(text[start:])]
        return ToolStreamState(text[:start], [c for c in calls if c is not None])
