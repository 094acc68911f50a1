"""What a request's output must match: a `GrammarSpec` (the `structured_outputs` field of
`SamplingParams`).

Five kinds, as OpenAI and vLLM name them: `json_schema` (a JSON Schema, as canonical JSON
text), `json_object` (any JSON object), `regex`, `choice` (one of a list of strings) and `ebnf`
(a grammar in GBNF/EBNF). Which kinds a grammar backend compiles is its capability
(`plugserve.grammar.GrammarCapabilities`); compiling checks the text itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str = ""  # the schema (canonical JSON), the regex or the EBNF; "" for json_object
    choices: tuple[str, ...] = field(default=())  # kind "choice"

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> GrammarSpec:
        """A JSON Schema given as a mapping or as JSON text (`ValueError` if the text is not
        JSON); kept as compact JSON (key order kept: it is the order of the output)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What the compile cache is keyed by."""
        return (self.kind, self.text, self.choices)

    def problems(self) -> list[str]:
        """Why this spec is malformed (wrong kind or types); the text itself is checked by
        compiling it."""
        if self.kind not in GRAMMAR_KINDS:
            return [f"structured_outputs kind must be one of {', '.join(GRAMMAR_KINDS)}, got "
                    f"{self.kind!r}"]
        if not isinstance(self.text, str):
            return [f"structured_outputs {self.kind} must be a string, got "
                    f"{type(self.text).__name__}"]
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                return ["structured_outputs choice must be a non-empty list of non-empty "
                        f"strings, got {list(self.choices)!r}"[:200]]
        elif self.kind != "json_object" and not self.text:
            return [f"structured_outputs {self.kind} must not be empty"]
        return []

    def describe(self) -> str:
        """One line naming the constraint, for errors and logs."""
        body = repr(list(self.choices)) if self.kind == "choice" else repr(self.text)
        if len(body) > 80:
            body = body[:77] + "..."
        return f"{self.kind} {body}" if self.kind != "json_object" else "json_object"
