"""xgrammar in the engine, through the Python API: the conformance suite passes; compiles are
cached by schema; constrained requests retracted for memory and prefilled again stay valid
(their matchers follow the kept tokens) under the checker, in both loops."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from plugserve.sampling import SamplingParams
from plugserve.structured import GrammarSpec
from plugserve.testing import EngineTest
from plugserve.testing.conformance.grammar.languages import SCHEMAS
from plugserve.testing.conformance.pytest_run import run_module


def test_the_conformance_suite_passes() -> None:
    assert run_module("plugserve.testing.conformance.grammar.suite",
                      ["--grammar-backend", "xgrammar"]) == 0


class TestXGrammarEngine(EngineTest):
    def test_compiles_are_cached_by_schema(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            specs = [GrammarSpec.json_schema(SCHEMAS[0]), GrammarSpec.json_schema(
                json.dumps(SCHEMAS[0])), GrammarSpec.regex("[ab]{3}")]
            results = engine.generate(["a"] * 3, [
                SamplingParams(max_new_tokens=40, structured_outputs=s) for s in specs])
            assert [r.finish_reason for r in results] == ["stop"] * 3
            assert engine.grammar is not None and engine.grammar.compiles == 2
            assert engine.stats()["step_time_s"]["grammar_mask"] > 0

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_retracted_requests_stay_valid(self, tiny_model_dir: Path, overlap: bool) -> None:
        schema = SCHEMAS[1]
        params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=i,
                                 structured_outputs=GrammarSpec.json_schema(schema))
                  for i in range(8)]
        with self.engine(model=str(tiny_model_dir), kv_pool_tokens=256, page_size=4,
                         overlap=overlap) as engine:
            results = engine.generate([f"prompt number {i}" for i in range(8)], params)
            assert engine.stats().get("retracted_reqs", 0) > 0, "nothing was retracted"
            for r in results:
                assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
                jsonschema.validate(json.loads(r.text), schema)
            self.assert_idle_memory_whole(engine)
