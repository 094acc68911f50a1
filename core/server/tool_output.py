"""Tool calls in chat answers: the answer's text -> `content` and `tool_calls`, full or
streamed as deltas.

- `auto`: the tool parser (`--tool-call-parser`, default hermes) reads the model's own format;
  while streaming, content is sent up to where a tool call may begin, and each tool call goes
  out as one delta (`index`, `id`, `type`, `function` with its whole `arguments`) once complete.
- `required` / a named function: the grammar forced the answer (plugserve.tools.choice); it is
  read back at the end, no content.
finish_reason is "tool_calls" when an `auto` or `required` answer made calls (OpenAI's; a named
function's answer ends with "stop", as OpenAI's does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plugserve.tools.base import ToolCall, ToolParser
from plugserve.tools.choice import named_calls, required_calls


@dataclass(frozen=True)
class ToolMode:
    kind: str  # auto, required or named
    parser: type[ToolParser] | None  # auto
    tools: Sequence[dict[str, Any]]
    name: str | None = None  # named


@dataclass
class ToolAnswer:
    """One choice's tool calls as its text arrives."""

    mode: ToolMode
    sent_content: str = ""
    sent_calls: int = 0
    calls: list[ToolCall] = field(default_factory=list)

    def _final_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        mode = self.mode
        if mode.kind == "named":
            assert mode.name is not None
            return None, named_calls(mode.name, text)
        if mode.kind == "required":
            calls = required_calls(text)
            return (text, []) if calls is None else (None, calls)
        assert mode.parser is not None
        return mode.parser(mode.tools).parse(text)

    def _reason(self, finish_reason: str | None, calls: list[ToolCall]) -> str | None:
        if finish_reason == "stop" and calls and self.mode.kind != "named":
            return "tool_calls"
        return finish_reason

    def full(self, text: str, finish_reason: str | None
             ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished answer."""
        if finish_reason != "stop":  # cut short: whatever came is content
            return text, [], finish_reason
        content, calls = self._final_calls(text)
        return content, calls, self._reason(finish_reason, calls)

    def stream(self, text: str, finish_reason: str | None
               ) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content delta, tool-call deltas, finish_reason) after the text so far."""
        if finish_reason is not None:
            content, calls, reason = self.full(text, finish_reason)
            if self.mode.kind != "auto" or not calls:
                content = content or ""
        elif self.mode.kind == "auto":
            assert self.mode.parser is not None
            state = self.mode.parser(self.mode.tools).parse_partial(text)
            content, calls, reason = state.content, state.calls, None
        else:
            content, calls, reason = "", [], None
        content = content or ""
        delta = content[len(self.sent_content):] if content.startswith(self.sent_content) \
            else ""
        self.sent_content += delta
        new = calls[self.sent_calls:]
        docs = [c.document(self.sent_calls + i) for i, c in enumerate(new)]
        self.sent_calls += len(new)
        self.calls += new
        if finish_reason is not None:
            reason = self._reason(finish_reason, self.calls)
        return delta, docs, reason


def tool_mode(body: Any, parser: type[ToolParser]) -> ToolMode | None:
    """How a chat request's answer is read for tool calls (None: tool_choice none or no
    tools). `body` is a ChatCompletionRequest; `parser` reads `auto` answers."""
    kind = body.tool_mode
    if kind == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    if kind == "named":
        return ToolMode("named", None, tools, body.tool_choice.function.name)
    if kind == "required":
        return ToolMode("required", None, tools)
    return ToolMode("auto", parser, tools)
