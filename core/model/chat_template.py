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
from pathlib import Path
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
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages`; `special_tokens` supplies bos_token, eos_token, ..."""
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **({"tools": [dict(t) for t in tools]} if tools else {}),
            **{k: v for k, v in special_tokens.items() if v is not None},
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc


def load_chat_template(path_or_text: str) -> str:
    """The template `--chat-template` names (vLLM's flag): a file holding one, or the Jinja
    text itself. Compiled once here, so a broken template stops start-up, not a request."""
    try:
        path = Path(path_or_text)
        is_file = len(path_or_text) < 4096 and path.is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {path_or_text!r}: cannot read the file: "
                                    f"{exc}") from None
    elif "{{" in path_or_text or "{%" in path_or_text:
        source = path_or_text
    else:
        raise ChatTemplateError(
            f"--chat-template {path_or_text!r}: no such file, and not a Jinja template (no "
            "'{{' or '{%' in it); give a template file or the template text")
    compile_chat_template(source)
    return source
