"""EAGLE on streaming sessions of a hybrid sliding-window target (its own SWA pool): every
turn's speculative greedy output equals the whole conversation decoded without speculation
and without a session, for a chain under the overlap loop and a tree under the normal loop,
with memory whole after every turn (checker level 1, physical checks on both pools)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import NUM_STEPS, greedy
from plugserve.engine import Engine
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir

TURNS = random_prompts(4, 256, 6, 30, seed=81)
TURN_TOKENS = 24


@pytest.fixture(scope="module")
def swa_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    from plugserve_spec_eagle.testing import make_tiny_head_dir

    root = tmp_path_factory.mktemp("spec_swa_sessions")
    target = make_tiny_model_dir(root / "target", arch="qwen2_swa", seed=9)
    head = make_tiny_head_dir(target, root / "head", trained=True)
    outputs, history = [], []
    with Engine(model=str(target), dtype="float32", cache="none") as engine:
        for turn in TURNS:
            history = history + turn
            out = engine.generate([history], greedy(TURN_TOKENS))[0].token_ids
            outputs.append(out)
            history = history + out
    return target, head, outputs


class TestSpecSWASessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    @pytest.mark.parametrize(("topk", "overlap"), [(1, True), (2, False)],
                             ids=["chain-overlap", "tree-normal"])
    def test_turns_match_whole_conversation(
        self, swa_target: tuple[Path, Path, list[list[int]]], topk: int, overlap: bool,
    ) -> None:
        target, head, expected = swa_target
        extra = {"spec_draft_tokens": 6} if topk > 1 else {}
        with self.engine(model=str(target), dtype="float32", spec="eagle",
                         draft_model=str(head), spec_steps=NUM_STEPS, spec_topk=topk,
                         page_size=4, chunked_prefill_size=16, overlap=overlap,
                         **extra) as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            sid = engine.open_session()
            for turn, want in zip(TURNS, expected, strict=True):
                (out,) = engine.generate([turn], greedy(TURN_TOKENS), session_id=sid)
                assert out.error is None and out.token_ids == want
                self.assert_idle_memory_whole(engine)
            assert engine.kv.swa_window is not None and engine.kv.swa_window.freed_slots > 0
            engine.close_session(sid)
            engine.scheduler.settle_idle()
            self.assert_idle_memory_whole(engine)
