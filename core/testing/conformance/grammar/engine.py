"""The backend in an engine on the tiny random model, the invariant checker at level 1: random
sampling under each declared kind gives only valid outputs ending with finish_reason "stop",
beside free requests whose tokens the constrained ones do not change, under the normal and the
overlap loops. A random model has no structure of its own: what structure the output has, the
grammar gave it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.structured import GrammarSpec
from plugserve.testing import EngineTest
from plugserve.testing.conformance.grammar.languages import LANGUAGES, SCHEMAS
from plugserve.testing.conformance.grammar.target import GrammarBackendUnderTest

FREE = SamplingParams(max_new_tokens=12)  # greedy, unconstrained


def _valid(spec: GrammarSpec, text: str) -> str | None:
    """Why `text` does not match `spec` (None: it does)."""
    if spec.kind in LANGUAGES:
        lang = next(lang for lang in LANGUAGES.values() if lang.spec == spec)
        return None if text in lang.words else f"{text!r} is not in the language"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"{text!r} is not JSON: {exc}"
    if spec.kind == "json_object":
        return None if isinstance(value, dict) else f"{text!r} is not a JSON object"
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(value, json.loads(spec.text))
    except jsonschema.ValidationError as exc:
        return f"{text!r} does not match the schema: {exc.message}"
    return None


def _specs(target: GrammarBackendUnderTest) -> list[GrammarSpec]:
    kinds = target.capabilities.kinds
    specs = [lang.spec for kind, lang in sorted(LANGUAGES.items()) if kind in kinds]
    if "json_schema" in kinds:
        specs += [GrammarSpec.json_schema(s) for s in SCHEMAS]
    # json_object is left out: any object at all has no bound a random model would reach.
    return specs


class TestGrammarEngine(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_constrained_and_free_requests_together(
            self, grammar_target: GrammarBackendUnderTest, tiny_model_dir: Path,
            overlap: bool) -> None:
        specs = _specs(grammar_target)
        if not specs:
            pytest.skip("the backend declares no kind")
        engine = self.engine(model=str(tiny_model_dir), grammar_backend=grammar_target.name,
                             overlap=overlap)
        try:
            alone = engine.generate(["free one", "free two"], FREE)
            constrained = [SamplingParams(max_new_tokens=160, temperature=1.0, seed=seed,
                                          structured_outputs=spec)
                           for spec in specs for seed in (1, 2)]
            prompts = ["free one", *["constrained"] * len(constrained), "free two"]
            results = engine.generate(prompts, [FREE, *constrained, FREE])
            problems: list[str] = []
            for result, params in zip(results[1:-1], constrained, strict=True):
                spec = params.structured_outputs
                assert spec is not None
                if result.finish_reason != "stop":
                    problems.append(f"{spec.describe()}: finished {result.finish_reason} "
                                    f"({result.error}) with {result.text!r}")
                    continue
                why = _valid(spec, result.text)
                if why is not None:
                    problems.append(f"{spec.describe()}: {why}")
            assert not problems, "\n".join(problems)
            assert [r.token_ids for r in (results[0], results[-1])] == \
                [r.token_ids for r in alone], "a constrained neighbour changed a free request"
            self.assert_idle_memory_whole(engine)
        finally:
            engine.close()

    def test_invalid_grammar_fails_its_request_only(
            self, grammar_target: GrammarBackendUnderTest, tiny_model_dir: Path) -> None:
        kinds = grammar_target.capabilities.kinds
        bad = next((s for k, s in (("regex", GrammarSpec.regex("a(b")),
                                   ("ebnf", GrammarSpec.ebnf("root ::= nothing_here")))
                    if k in kinds), None)
        if bad is None:
            pytest.skip("the backend declares neither regex nor ebnf")
        engine = self.engine(model=str(tiny_model_dir), grammar_backend=grammar_target.name)
        try:
            results = engine.generate(["x", "y"], [
                SamplingParams(max_new_tokens=4, structured_outputs=bad), FREE])
            assert results[0].finish_reason == "error" and results[0].error
            assert results[1].finish_reason == "length" and len(results[1].token_ids) == 12
            self.assert_idle_memory_whole(engine)
        finally:
            engine.close()


