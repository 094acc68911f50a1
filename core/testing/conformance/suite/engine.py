"""Engine-level suite: whole generations on the tiny models with the backend under test,
token-identical to transformers fp32, the checker at level 1 (see `engine_checks`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.testing.conformance import engine_checks as checks
from plugserve.testing.conformance.engine_checks import EngineCase, paged
from plugserve.testing.conformance.models import eagle_head_dir, sliding_window_model_dir
from plugserve.testing.conformance.requirements import requires
from plugserve.testing.conformance.suite.base import ConformanceTest
from plugserve.testing.engine_test import EngineTest

__all__ = ["TestEngineGreedy", "TestEngineHalfPrecision", "TestEngineSpeculative"]

PAGES = pytest.mark.parametrize("case", [paged(1), paged(16)], ids=str)


def _root(factory: pytest.TempPathFactory) -> str:
    return str(factory.getbasetemp())


@requires("dtype:float32")
class GreedyEngineTest(ConformanceTest, EngineTest):
    """Base of the fp32 engine tests: `generate` runs the workload and checks everything."""

    def generate(self, model_dir: Path, kind: str, case: EngineCase, rounds: int = 1,
                 **overrides: Any) -> dict[str, Any]:
        expected = checks.hf_reference(str(model_dir), kind)
        with self.engine(model=str(model_dir), attention=self.target.name, dtype="float32",
                         device=self.target.device, **case.overrides, **overrides) as engine:
            checks.run_generations(engine, self.target, kind, rounds=rounds, expected=expected,
                                   expect_mixed=bool(overrides.get("enable_mixed_chunk")))
            return engine.stats()


class TestEngineGreedy(GreedyEngineTest):
    """fp32 greedy == transformers fp32, across the scheduler's paths."""

    @PAGES
    def test_mixed_lengths_and_prefix_cache(self, case: EngineCase,
                                            tiny_model_dir: Path) -> None:
        stats = self.generate(tiny_model_dir, "mixed", case, rounds=2)
        checks.assert_second_round_cached(stats, "mixed", case.overrides["page_size"])

    @PAGES
    def test_chunked_prefill_and_mixed_chunk(self, case: EngineCase,
                                             tiny_model_dir: Path) -> None:
        self.generate(tiny_model_dir, "mixed", case, chunked_prefill_size=16,
                      enable_mixed_chunk=True)

    @PAGES
    def test_retracts_on_a_small_pool(self, case: EngineCase, tiny_model_dir: Path) -> None:
        stats = self.generate(tiny_model_dir, "long", case, kv_pool_tokens=128)
        assert stats["retracted_reqs"], "the small pool was meant to force retracts"

    @PAGES
    def test_overlap_loop(self, case: EngineCase, tiny_model_dir: Path) -> None:
        self.generate(tiny_model_dir, "mixed", case, rounds=2, overlap=True,
                      chunked_prefill_size=16)

    @requires("sliding_window")
    def test_sliding_window_model(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        model_dir = sliding_window_model_dir(_root(tmp_path_factory))
        self.generate(model_dir, "mixed", paged(4), rounds=2, chunked_prefill_size=16)


SPEC_CASES = [
    EngineCase("chain-page1", {"page_size": 1, "spec_topk": 1}, ("speculative",)),
    EngineCase("tree-page1", {"page_size": 1, "spec_topk": 2, "spec_draft_tokens": 4},
               ("topk_gt1",)),
    EngineCase("tree-page16-overlap", {"page_size": 16, "spec_topk": 2, "spec_draft_tokens": 4,
                                       "overlap": True}, ("page_tree", "page_size:16")),
]


@requires("dtype:float32", "spec_algorithm:eagle")
class TestEngineSpeculative(ConformanceTest, EngineTest):
    """EAGLE drafting and tree verify through the backend stay lossless."""

    @pytest.mark.parametrize("case", SPEC_CASES, ids=str)
    def test_speculative_greedy_is_lossless(
        self, case: EngineCase, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        head = eagle_head_dir(str(tiny_model_dir), _root(tmp_path_factory))
        expected = checks.hf_reference(str(tiny_model_dir), "mixed")
        with self.engine(model=str(tiny_model_dir), attention=self.target.name,
                         dtype="float32", device=self.target.device, spec="eagle",
                         draft_model=str(head), spec_steps=3, **case.overrides) as engine:
            checks.run_generations(engine, self.target, "mixed", expected=expected,
                                   probe_layers=False)

    @requires("sliding_window", "topk_gt1")
    def test_sliding_window_tree_is_lossless(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """Tree verify on sliding-window layers: a node's window counts positions."""
        root = _root(tmp_path_factory)
        model_dir = sliding_window_model_dir(root)
        head = eagle_head_dir(str(model_dir), root)
        expected = checks.hf_reference(str(model_dir), "mixed")
        with self.engine(model=str(model_dir), attention=self.target.name, dtype="float32",
                         device=self.target.device, spec="eagle", draft_model=str(head),
                         spec_steps=3, page_size=1, spec_topk=4,
                         spec_draft_tokens=8) as engine:
            checks.run_generations(engine, self.target, "mixed", expected=expected,
                                   probe_layers=False)


class TestEngineHalfPrecision(ConformanceTest, EngineTest):
    """bf16/fp16: every token a near-argmax of transformers fp32 (teacher-forced)."""

    @pytest.mark.parametrize("dtype", [
        pytest.param(EngineCase("bfloat16", {"dtype": "bfloat16"},
                                ("dtype:bfloat16", "page_size:16")), id="bf16"),
        pytest.param(EngineCase("float16", {"dtype": "float16"},
                                ("dtype:float16", "page_size:16")), id="fp16"),
    ])
    def test_near_greedy(self, dtype: EngineCase, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), attention=self.target.name,
                         device=self.target.device, page_size=16, chunked_prefill_size=16,
                         **dtype.overrides) as engine:
            outputs = checks.run_generations(engine, self.target, "mixed", expected=None)
        checks.assert_near_greedy(str(tiny_model_dir), "mixed", outputs[0], dtype.id)
