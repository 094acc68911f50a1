"""Tool calls in chat: the parser contract (`base`), the built-in Hermes/Qwen parser
(`hermes`) and the grammars that enforce `tool_choice` "required" or a named function
(`choice`). Parsers are a plugin point: `plugserve_register_tool_parsers`."""

from __future__ import annotations

from plugserve.tools.base import ToolCall, ToolParser, ToolStreamState

__all__ = ["ToolCall", "ToolParser", "ToolStreamState"]
