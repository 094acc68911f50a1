"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Types are strict (`"1"` is not a number, `true` is not an int) and unknown fields are
refused, so a typo is a 400 naming the field instead of a silent no-op. Values are checked
where the engine cannot: OpenAI's own fields (`n`, `logprobs`, `max_tokens`, the prompt's
shape); sampling values (temperature, top_p, top_k, seed, stop) are checked by the engine
(`SamplingParams.problems`) so both refuse the same things with the same words.

To extend a body, add a field to `GenerationFields` or to one request class;
`plugserve.server.sampling` turns the fields into engine arguments. `session_id` (from
`POST /v1/sessions`) makes the request one turn of a streaming session: the prompt (or the
rendered messages) holds only the turn's new tokens, appended after `session_offset` tokens
of the conversation when given.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Prompt = str | list[int]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class GenerationFields(Body):
    """Fields both endpoints share (OpenAI's, plus vLLM-style extensions)."""

    model: str | None = None  # None: the served model
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted, unused
    # Extensions (vLLM names).
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    return_token_ids: bool = Field(
        default=False, description="add the generated token ids to each choice / chunk"
    )
    # Streaming sessions (plugserve extension).
    session_id: str | None = None
    session_offset: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"n must be 1, got {value}: this server returns one choice per prompt; send "
                "the prompt several times (with different seeds) for more"
            )
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _positive_tokens(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


class CompletionRequest(GenerationFields):
    prompt: Any = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists"
    )
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> list[Prompt]:
        return prompt_list(value)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        return _positive_tokens(value, "max_tokens")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and value != 0:
            raise ValueError(
                f"logprobs must be 0 or null, got {value}: the engine returns the sampled "
                "token's logprob only (logprobs=0), not the top alternatives"
            )
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; leave it out or false")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of must be 1, got {value}: one choice per prompt")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported; leave it out")
        return value

    @property
    def prompts(self) -> list[Prompt]:
        return list(self.prompt)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must hold at least one message")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: Any) -> int | None:
        return _positive_tokens(value, info.field_name)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError(
                f"top_logprobs must be 0 or null, got {value}: the engine returns the sampled "
                "token's logprob only"
            )
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def prompt_list(value: Any) -> list[Prompt]:
    """The prompts of a completions request: each a string or a list of token ids."""
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of " \
            "token-id lists"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"{shape}; got {type(value).__name__}")
    if not value:
        raise ValueError("prompt is an empty list; give at least one prompt")
    if all(_is_token(t) for t in value):
        return [list(value)]
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, list) and all(_is_token(t) for t in p) for p in value):
        return [list(p) for p in value]
    raise ValueError(f"{shape}, not a mix; got {_describe_items(value)}")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe_items(items: list[Any]) -> str:
    kinds = sorted({type(item).__name__ for item in items})
    return f"a list of {' and '.join(kinds)}"
