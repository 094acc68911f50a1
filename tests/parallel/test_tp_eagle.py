"""EAGLE at TP=2: the draft head replicated on every rank, drafting over the target's
vocabulary-parallel LM head; lossless against plain TP=2 greedy decoding (chain at page 1,
tree at page 16 under the overlap loop)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.conformance.models import eagle_head_dir
from plugserve.testing.reference import random_prompts

pytestmark = pytest.mark.integration  # runs the spec_eagle plugin

VOCAB = 256
CASES = {
    "chain-page1": {"page_size": 1, "spec_topk": 1},
    "tree-page16-overlap": {"page_size": 16, "spec_topk": 2, "spec_draft_tokens": 4,
                            "overlap": True},
}


@pytest.fixture(scope="module")
def head_dir(tp_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return eagle_head_dir(str(tp_models("llama")), str(tmp_path_factory.mktemp("tp_eagle")))


@pytest.fixture(scope="module")
def plain_tp2(tp_models: Callable[[str], Path]) -> list[list[int]]:
    prompts, sp = _workload()
    with EngineTest().engine(model=str(tp_models("llama")), tp_size=2, mem_check=1,
                             check_pages=True) as engine:
        return [r.token_ids for r in engine.generate(prompts, sp)]


def _workload() -> tuple[list[list[int]], SamplingParams]:
    prompts = random_prompts(6, VOCAB, 3, 40, seed=1)
    return prompts, SamplingParams(max_new_tokens=24, ignore_eos=True)


class TestTensorParallelEagle(EngineTest):
    @pytest.mark.parametrize("case", list(CASES))
    def test_lossless_against_plain_tp2(
        self, case: str, plain_tp2: list[list[int]], tp_models: Callable[[str], Path],
        head_dir: Path,
    ) -> None:
        prompts, sp = _workload()
        with self.engine(model=str(tp_models("llama")), tp_size=2, spec="eagle",
                         draft_model=str(head_dir),
                         spec_steps=3, **CASES[case]) as engine:
            results = engine.generate(prompts, sp)
            assert [r.token_ids for r in results] == plain_tp2
            rounds = sum(r.stats.get("spec_verify_steps", 0) for r in results)
            accepted = sum(r.stats.get("spec_accepted_tokens", 0) for r in results)
            assert rounds > 0, "speculative rounds were meant to run"
            assert accepted > 0, "the head was meant to get some drafts accepted"
            self.assert_idle_memory_whole(engine)
