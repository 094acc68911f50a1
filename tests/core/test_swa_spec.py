"""EAGLE speculative decoding on a hybrid sliding-window target with its own SWA pool:
greedy output identical to plain greedy (and to transformers), for a chain and a tree with
page_size > 1, under the normal and overlap loops. The accepted-KV move (`copy_slots`)
translates for the windowed layers; the draft head keeps its own full pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir

pytest.importorskip("plugserve_spec_eagle")
pytestmark = pytest.mark.integration  # runs the eagle plugin

PROMPTS = random_prompts(3, 256, 30, 60, seed=51)
MAX_NEW = [40, 30, 50]


@pytest.fixture(scope="module")
def swa_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    root = tmp_path_factory.mktemp("swa_spec")
    target = make_tiny_model_dir(root / "target", arch="qwen2_swa", seed=9)
    head = make_tiny_head_dir(target, root / "head", trained=False)
    return target, head, hf_greedy(target, PROMPTS, MAX_NEW)


class TestSpecOnSWATarget(EngineTest):
    @pytest.mark.parametrize(("topk", "loop"), [(1, "overlap"), (2, "normal")],
                             ids=["chain-overlap", "tree-normal"])
    def test_lossless(self, swa_target: tuple[Path, Path, list[list[int]]], topk: int,
                      loop: str) -> None:
        target, head, expected = swa_target
        sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
        with self.engine(model=str(target), spec="eagle", draft_model=str(head),
                         spec_steps=3, spec_topk=topk, page_size=4, chunked_prefill_size=16,
                         overlap=loop == "overlap") as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            results = engine.generate(PROMPTS, sampling)
            assert [r.error for r in results] == [None] * len(PROMPTS)
            assert [r.token_ids for r in results] == expected
            assert engine.kv.swa_window is not None and engine.kv.swa_window.freed_slots > 0
            self.assert_idle_memory_whole(engine)
