"""The tool-call parser contract: how one model family writes tool calls in its text.

A parser turns the text of a finished answer into (content, tool calls) and, while the answer
streams, says how much of the text so far is plain content (safe to send) and which tool calls
are complete. It is built per request with the request's `tools` (OpenAI's list).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)

    def document(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolStreamState:
    """What a streamed answer has shown so far: the content that may be sent (a possible
    start of a tool-call tag is held back) and the tool calls that are complete."""

    content: str
    calls: list[ToolCall]


class ToolParser(ABC):
    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.tools = list(tools)

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished answer: its content (None when it holds only tool calls) and calls."""

    @abstractmethod
    def parse_partial(self, text: str) -> ToolStreamState:
        """The text streamed so far (it only grows): what may be sent as content yet and the
        tool calls already complete."""
