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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

Prompt = str | list[int]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may carry lone surrogates ("\\udcff"): no tokenizer can take them. Refused here,
        naming the field, before any field is read."""
        where = lone_surrogate_at(data, ())
        if where is not None:
            path, value = where
            raise PydanticCustomError(
                "invalid_unicode", "{field}: text is not valid Unicode (a lone surrogate at "
                "character {at}); send UTF-8 text",
                {"field": path or "body", "at": next(i for i, c in enumerate(value)
                                                     if 0xD800 <= ord(c) <= 0xDFFF)})
        return data


class StreamOptions(Body):
    include_usage: bool = False


def lone_surrogate_at(value: Any, path: tuple[str, ...]) -> tuple[str, str] | None:
    """The dotted path and text of the first string (or key) holding a lone surrogate."""
    if isinstance(value, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            return ".".join(path), value
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_at(key, (*path, "<key>")) or lone_surrogate_at(
                item, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, (*path, str(i)))
            if found is not None:
                return found
    return None


class JsonSchemaFormat(Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is constrained either way


class ResponseFormat(Body):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise PydanticCustomError(
                "value_error", "response_format: type json_schema needs json_schema.schema", {})
        return self


class StructuredOutputsBody(Body):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsBody:
        given = [name for name, value in (("json", self.json_), ("regex", self.regex),
                                          ("choice", self.choice), ("grammar", self.grammar),
                                          ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "value_error", "structured_outputs: give exactly one of json, regex, choice, "
                "grammar, json_object (got: {given})", {"given": ", ".join(given) or "none"})
        return self


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added logit
    # Extensions (vLLM names).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = Field(
        default=False, description="add the generated token ids to each choice / chunk"
    )
    stream_interval: int | None = Field(
        default=None, description="generated tokens per streamed chunk; raises the server's "
        "--stream-interval for this request (vLLM's field)"
    )
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # Streaming sessions (plugserve extension).
    session_id: str | None = None
    session_offset: int | None = None

    @field_validator("n")
    @classmethod
    def _some_choices(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"n must be at least 1, got {value}")
        return value  # the upper bound is the server's --max-n

    @field_validator("stream_interval")
    @classmethod
    def _interval(cls, value: int | None) -> int | None:
        return _positive_tokens(value, "stream_interval")

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
    max_tokens: int | None = None  # None: 16 (OpenAI's default), or what the context leaves
    logprobs: int | None = None  # N: each token's logprob and the N most likely (0..20)
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
        if value is not None and value < 0:
            raise ValueError(f"max_tokens must be at least 0 (0 only with echo), got {value}")
        return value

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "value_error", "max_tokens: 0 needs echo=true (the prompt and its logprobs "
                "back, nothing generated); otherwise ask for at least 1", {})
        return self

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError(
                "value_error", "best_of must be at least n ({n}), got {best_of}",
                {"n": self.n, "best_of": self.best_of})
        return self

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


class FunctionCallBody(Body):
    name: str
    arguments: str  # JSON text


class ToolCallBody(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates read the arguments as an object (vLLM passes them parsed too).
            out["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name,
                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return out


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the N most likely tokens too (0..20)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

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

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "value_error", "top_logprobs: needs logprobs=true (got top_logprobs={n})",
                {"n": self.top_logprobs})
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise PydanticCustomError(
                    "value_error", "tool_choice: {choice} needs tools", {
                        "choice": "required" if choice == "required" else "a named function"})
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if choice.function.name not in names:
                raise PydanticCustomError(
                    "value_error", "tool_choice: function {name!r} is not in tools (tools: "
                    "{names})", {"name": choice.function.name, "names": ", ".join(names)})
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

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
