"""Rendering a model's Jinja chat template the way HF transformers does.

The template runs in a sandbox with `trim_blocks`/`lstrip_blocks`, the loop-control
extension, a `tojson` that keeps non-ASCII text, and the helpers `raise_exception` and
`strftime_now` that published templates call.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template refused the messages or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from exc


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
) -> str:
    """The prompt text for `messages`; `special_tokens` supplies bos_token, eos_token, ..."""
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in special_tokens.items() if v is not None},
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc
