"""A live server (loopback, in this process) on the tiny random model with the checker at level
1, the xgrammar backend selected, and a chat template that renders tools the Hermes / Qwen way.
Stopped, with its memory checked whole at idle, when the module ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from plugserve.engine import Engine
from plugserve.server.background import BackgroundServer
from plugserve.testing.memory import assert_memory_whole

TOOLS_TEMPLATE = (
    "{% if tools %}<|user|>You may call:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}</s>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}"
    "</tool_response></s>"
    "{% elif message.get('tool_calls') %}<|assistant|>{% for c in message['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}</s>"
    "{% else %}{{ '<|user|>' if message['role'] == 'user' else '<|assistant|>' }}"
    "{{ message['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def engine_mode() -> str:
    """Where the engine runs: "thread" (this process) or "process" (`EngineProcess`)."""
    return "thread"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, engine_mode: str) -> Iterator[BackgroundServer]:
    settings = {"model": str(tiny_model_dir), "mem_check": 1, "check_pages": True,
                "grammar_backend": "xgrammar"}
    if engine_mode == "process":
        from plugserve.config import EngineConfig
        from plugserve.server.engine_process import EngineProcess

        engine: Any = EngineProcess(EngineConfig(**settings))
    else:
        engine = Engine(**settings)
    engine.tokenizer.chat_template = TOOLS_TEMPLATE  # the HTTP side renders the messages
    try:
        with BackgroundServer(engine) as live:
            yield live
        assert live.engine_loop.failure is None
        assert live.engine_loop.idle_memory_problem is None  # the last idle check
        if engine_mode == "thread":
            assert_memory_whole(engine)
    finally:
        engine.close()


@pytest.fixture
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(server: BackgroundServer) -> str:
    return str(server.app.state.server.model_id)
