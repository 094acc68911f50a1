"""A request's structured-output fields -> the engine's `GrammarSpec`.

`response_format` (OpenAI: `json_object`, `json_schema`) and `structured_outputs` (vLLM:
`json`, `regex`, `choice`, `grammar`, `json_object`) on both endpoints; in chat, `tool_choice`
"required" or a named function is one more source (plugserve.tools.choice). At most one may
constrain a request. The grammar itself is compiled by the engine's grammar backend: a schema,
regex or grammar it refuses is a 400 naming the field (`ServerState.respond`).
"""

from __future__ import annotations

from typing import Any

from plugserve.server.errors import APIError
from plugserve.server.protocol import ChatCompletionRequest, GenerationFields, NamedToolChoice
from plugserve.structured import GrammarSpec
from plugserve.tools.choice import named_schema, required_schema


def _spec(build: Any, *args: Any, param: str) -> GrammarSpec:
    try:
        spec: GrammarSpec = build(*args)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec


def body_grammar(body: GenerationFields) -> tuple[GrammarSpec | None, str | None]:
    """(the spec, the field it came from) of response_format / structured_outputs."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec.json_object(), "response_format"
    if fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        return _spec(GrammarSpec.json_schema, fmt.json_schema.schema_,
                     param="response_format"), "response_format"
    if so is None:
        return None, None
    param = "structured_outputs"
    if so.json_ is not None:
        return _spec(GrammarSpec.json_schema, so.json_, param=param), param
    if so.regex is not None:
        return GrammarSpec.regex(so.regex), param
    if so.choice is not None:
        return GrammarSpec.choice(so.choice), param
    if so.grammar is not None:
        return GrammarSpec.ebnf(so.grammar), param
    return GrammarSpec.json_object(), param


def chat_grammar(body: ChatCompletionRequest) -> tuple[GrammarSpec | None, str | None]:
    """The body's grammar, or the one `tool_choice` required / named imposes."""
    spec, param = body_grammar(body)
    mode = body.tool_mode
    if mode not in ("required", "named"):
        return spec, param
    if spec is not None:
        raise APIError(400, f"tool_choice {mode!r} constrains the output itself; it cannot be "
                            f"combined with {param}", param="tool_choice")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or ()]
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        name = body.tool_choice.function.name
        tool = next(t for t in tools if t["function"]["name"] == name)
        return _spec(GrammarSpec.json_schema, named_schema(tool), param="tools"), "tools"
    return _spec(GrammarSpec.json_schema, required_schema(tools), param="tools"), "tools"
