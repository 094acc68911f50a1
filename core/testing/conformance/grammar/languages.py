"""Small finite languages, one per request kind, with the exact set of strings each allows: the
oracle the suite compares a backend's masks with (which tokens may come next, and when the
end — an EOS token — may)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from plugserve.structured import GrammarSpec


@dataclass(frozen=True)
class Language:
    spec: GrammarSpec
    words: frozenset[str]

    def allows_next(self, prefix: str, text: str) -> bool:
        return any(w.startswith(prefix + text) for w in self.words)

    def complete(self, prefix: str) -> bool:
        return prefix in self.words


CHOICE = Language(GrammarSpec.choice(["yes", "no", "nope", "maybe"]),
                  frozenset({"yes", "no", "nope", "maybe"}))
REGEX = Language(GrammarSpec.regex(r"[a-c]{2}[0-3]"),
                 frozenset("".join(p) for p in itertools.product("abc", "abc", "0123")))
EBNF = Language(GrammarSpec.ebnf('root ::= "a" ("b" | "cd") "!"?'),
                frozenset({"ab", "acd", "ab!", "acd!"}))
# Compact JSON only when the backend allows no free whitespace; the oracle is not exact for
# JSON, so JSON kinds are checked on generated outputs instead.
LANGUAGES: dict[str, Language] = {"choice": CHOICE, "regex": REGEX, "ebnf": EBNF}

# Inputs each kind must refuse with a GrammarError.
INVALID: dict[str, GrammarSpec] = {
    "regex": GrammarSpec.regex("a(b"),
    "ebnf": GrammarSpec.ebnf("root ::= undefined_rule"),
    "json_schema": GrammarSpec("json_schema", '{"type": "object", "properties": '),
}

# JSON schemas the engine tests generate against: nested objects, enums, arrays, required
# keys; strings and numbers bounded so a random model finishes them (a string bounded by a
# pattern: xgrammar 0.2.8 lets `maxLength` strings hold raw control characters, which is not
# JSON).
SCHEMAS: list[dict[str, object]] = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object",
     "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                             "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object",
     "properties": {"point": {"type": "object",
                              "properties": {"x": {"type": "integer", "minimum": -9,
                                                   "maximum": 9},
                                             "y": {"type": "boolean"}},
                              "required": ["x", "y"], "additionalProperties": False},
                    "label": {"enum": ["up", "down", None]}},
     "required": ["point", "label"], "additionalProperties": False},
]
