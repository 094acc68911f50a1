"""How the engine runs constrained requests, on the toy grammar backend (toy_grammars.py):
a grammar still compiling holds back its own request only (the others run to the end
meanwhile); a failed compile ends its request with the message; a request finishing because
its grammar is complete says "stop"; a request for a kind the backend lacks, or with no
backend installed, is refused naming the reason."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from plugserve.sampling import SamplingParams
from plugserve.structured import GrammarSpec
from plugserve.testing import EngineTest

CHOICE = GrammarSpec.choice(["yes", "no"])


class TestGrammarScheduling(EngineTest):
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_a_compile_in_progress_stalls_only_its_request(
            self, grammar_plugins: None, tiny_model_dir: Path, overlap: bool) -> None:
        gate = threading.Event()
        with self.engine(model=str(tiny_model_dir), grammar_backend="toy_choice",
                         overlap=overlap) as engine:
            assert engine.grammar is not None
            backend = engine.grammar.backend
            compile_now = backend.compile

            def slow_compile(spec: GrammarSpec) -> Any:
                assert gate.wait(30), "the test never opened the gate"
                return compile_now(spec)

            backend.compile = slow_compile  # type: ignore[method-assign]
            constrained = engine.submit("a", SamplingParams(max_new_tokens=8, temperature=1.0,
                                                            seed=1, structured_outputs=CHOICE))
            free = engine.submit("b", SamplingParams(max_new_tokens=6))
            for _ in range(200):
                if free.finished():
                    break
                engine.step()
            assert free.finished_reason == "length" and len(free.output_ids) == 6
            assert not constrained.finished() and constrained.req_pool_idx is None
            gate.set()
            for _ in range(2000):
                if not engine.step() and engine.is_idle():
                    break
            assert constrained.finished_reason == "stop"
            text = engine.tokenizer.decode(constrained.output_ids)
            assert text in ("yes", "no")
            self.assert_idle_memory_whole(engine)

    def test_refusals(self, grammar_plugins: None, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), grammar_backend="toy_choice") as engine:
            results = engine.generate(["a", "b", "c"], [
                SamplingParams(max_new_tokens=4, structured_outputs=GrammarSpec.regex("a+")),
                SamplingParams(max_new_tokens=4, structured_outputs=GrammarSpec("yaml", "x")),
                SamplingParams(max_new_tokens=4),
            ])
            assert "does not support regex (it supports: choice)" in str(results[0].error)
            assert "kind must be one of json_schema" in str(results[1].error)
            assert results[2].error is None
            self.assert_idle_memory_whole(engine)

    def test_no_backend_installed(self, tiny_model_dir: Path) -> None:
        from plugserve.config import EngineConfig
        from plugserve.engine import Engine

        # Only the checker beside the built-ins: no grammar backend at all.
        with Engine(EngineConfig(model=str(tiny_model_dir), plugins="checker")) as engine:
            result = engine.generate(["a"], SamplingParams(structured_outputs=CHOICE))[0]
            assert result.finish_reason == "error"
            assert "need a grammar backend; 'xgrammar' is not installed" in str(result.error)

    def test_unknown_backend_named_is_refused_at_start(self, grammar_plugins: None,
                                                      tiny_model_dir: Path) -> None:
        from plugserve.engine import EngineStartError

        with pytest.raises(EngineStartError, match=r"unknown grammar backend 'nope'.*toy_choice"):
            self.engine(model=str(tiny_model_dir), grammar_backend="nope")
