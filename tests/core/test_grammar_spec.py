"""Structured outputs with speculative decoding are refused, per request, with a clear error
(the drafts are not checked against the grammar yet): the constrained request fails alone,
the free one beside it is served, the memory stays whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.structured import GrammarSpec
from plugserve.testing import EngineTest
from plugserve.testing.tiny_models import make_tiny_model_dir

pytest.importorskip("plugserve_spec_eagle")
pytest.importorskip("plugserve_grammar_xgrammar")
pytestmark = pytest.mark.integration  # runs the eagle and xgrammar plugins


class TestGrammarWithEagle(EngineTest):
    def test_constrained_request_is_refused(self, tmp_path: Path) -> None:
        from plugserve_spec_eagle.testing import make_tiny_head_dir

        target = make_tiny_model_dir(tmp_path / "target", seed=3)
        head = make_tiny_head_dir(target, tmp_path / "head", trained=False)
        with self.engine(model=str(target), spec="eagle", draft_model=str(head),
                         spec_steps=2) as engine:
            constrained = SamplingParams(max_new_tokens=8,
                                         structured_outputs=GrammarSpec.regex("[ab]+"))
            results = engine.generate(["x", "y"], [constrained, SamplingParams(max_new_tokens=8)])
            assert results[0].finish_reason == "error"
            assert "structured_outputs cannot be used with speculative decoding" in \
                str(results[0].error)
            assert results[1].error is None and len(results[1].token_ids) == 8
            self.assert_idle_memory_whole(engine)
