"""Structured outputs and tools with the engine in a process of its own (`plugserve serve
--engine-process`): the grammar is compiled in the engine process (an invalid one is still a
400 naming the field), the HTTP process parses tool calls. A representative subset of the two
server modules, run here against an `EngineProcess`."""

from __future__ import annotations

import pytest
from test_server_structured import (  # noqa: F401  (collected here, with the process engine)
    test_completions_json_schema,
    test_invalid_constraints_are_400,
    test_regex_choice_and_grammar,
)
from test_server_tools import test_auto_parses_hermes_tool_calls, test_required  # noqa: F401


@pytest.fixture(scope="module")
def engine_mode() -> str:
    return "process"
