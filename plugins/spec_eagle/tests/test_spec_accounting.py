"""EAGLE under memory pressure and churn, checker at level 1: multi-turn conversations that
cross many page boundaries, pools small enough to force retracts, aborts while a round is in
flight; output stays lossless where it is compared and the pools are whole at idle."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from conftest import NUM_STEPS, PROMPTS, greedy
from plugserve.attention import whitelist
from plugserve.engine import Engine, EngineStartError
from plugserve.testing import EngineTest

TURN_TOKENS = 48


class _Rowless:
    """A request whose row a retract just cleared; everything else reads through."""

    req_pool_idx = None

    def __init__(self, req: Any) -> None:
        self._req = req

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)

USER_TURNS = [[7, 8, 9], [60, 61, 62, 63, 64], [120, 3]]


def _conversation(engine: Engine, first: list[int]) -> list[list[int]]:
    """Three turns; each turn's prompt is the whole conversation so far plus new user tokens."""
    history = list(first)
    outputs = []
    for user in USER_TURNS:
        out = engine.generate([history], greedy(TURN_TOKENS))[0]
        outputs.append(out.token_ids)
        history = history + out.token_ids + user
    return outputs


@pytest.fixture(scope="module")
def plain_conversations(target_dir: Path) -> list[list[list[int]]]:
    with Engine(model=str(target_dir), dtype="float32") as engine:
        return [_conversation(engine, p) for p in PROMPTS[:2]]


class TestSpecAccounting(EngineTest):
    def spec(self, target: Path, head: Path, **kw: Any) -> Engine:
        cfg: dict[str, Any] = dict(model=str(target), dtype="float32", spec="eagle",
                                   draft_model=str(head), spec_steps=NUM_STEPS, page_size=16,
                                   spec_topk=4)
        cfg.update(kw)
        return self.engine(**cfg)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_multi_turn_long_generations(
        self, overlap: bool, target_dir: Path, trained_head_dir: Path,
        plain_conversations: list[list[list[int]]],
    ) -> None:
        with self.spec(target_dir, trained_head_dir, overlap=overlap) as engine:
            for prompt, plain in zip(PROMPTS[:2], plain_conversations, strict=True):
                assert _conversation(engine, prompt) == plain
                self.assert_idle_memory_whole(engine)
            # Later turns reuse the cached conversation.
            assert engine.stats()["cache_evictable_slots"] > 0

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_small_pool_forces_retracts(
        self, overlap: bool, target_dir: Path, trained_head_dir: Path,
        reference: list[list[int]],
    ) -> None:
        # Each request keeps a reserve of 2 * 128 slots past its tokens (page 16, topk 4):
        # 4 requests cannot all run in 640 slots.
        with self.spec(target_dir, trained_head_dir, overlap=overlap,
                       kv_pool_tokens=640) as engine:
            out = engine.generate(PROMPTS, greedy())
            assert [r.token_ids for r in out] == reference
            assert engine.stats()["retracted_reqs"] > 0
            self.assert_idle_memory_whole(engine)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_abort_while_a_round_is_in_flight(
        self, overlap: bool, target_dir: Path, trained_head_dir: Path,
        reference: list[list[int]],
    ) -> None:
        with self.spec(target_dir, trained_head_dir, overlap=overlap) as engine:
            sched = engine.scheduler
            reqs = [engine.submit(p, greedy()) for p in PROMPTS]
            aborted = set()
            steps = 0
            while sched.step():
                steps += 1
                # Under overlap a round is in flight right now for every decoding request.
                for i in (1, 3):
                    req = reqs[i]
                    if i not in aborted and len(req.output_ids) >= 4 * i:
                        assert engine.abort(req)
                        aborted.add(i)
            sched.settle_idle()
            assert aborted == {1, 3}
            for i, req in enumerate(reqs):
                if i in aborted:
                    assert req.finished_reason == "abort"
                    assert req.output_ids == reference[i][: len(req.output_ids)]
                else:
                    assert req.output_ids == reference[i]
            self.assert_idle_memory_whole(engine)

    def test_whitelist_refuses_page_tree_for_other_backends(
        self, target_dir: Path, trained_head_dir: Path, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setattr(whitelist, "PAGE_TREE_WHITELIST",
                            (("plugserve-attention-triton", "triton"),))
        with pytest.raises(EngineStartError, match=r"attention backend 'torch_native' \(.*\) "
                           r"may not run page_size>1.*allowed backends: triton \(plugserve-"):
            self.spec(target_dir, trained_head_dir)
        # topk>1 at page_size 1 is a separate capability: still fine.
        with self.spec(target_dir, trained_head_dir, page_size=1) as engine:
            engine.generate(PROMPTS[:1], greedy(4))

    def test_row_check_names_both_numbers(
        self, target_dir: Path, trained_head_dir: Path,
    ) -> None:
        with self.spec(target_dir, trained_head_dir) as engine:
            req = engine.submit(PROMPTS[0], greedy(4))
            req.kv_committed_len = 10
            width = engine.kv.rows.row_width
            with pytest.raises(RuntimeError, match=rf"needs allocated length {width + 1} but "
                                                   rf"its req_to_token row is only {width}"):
                engine.kv.check_row_fits(req, width + 1, "the next speculative round")
            engine.abort(req)

    def test_round_reads_the_rows_the_batch_was_prepared_with(
        self, target_dir: Path, trained_head_dir: Path, reference: list[list[int]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Under the overlap loop the scheduler may clear `req.req_pool_idx` (a retract)
        while a round is in flight: the round must use the batch's snapshot of the rows,
        never the live field (which once sent it to row 0, another request's KV)."""
        with self.spec(target_dir, trained_head_dir, overlap=True) as engine:
            spec = engine.spec
            assert spec is not None
            decode = spec.decode

            def decode_with_rows_cleared(step: Any) -> Any:
                # The round sees each request as a retract left it (row cleared); the real
                # requests stay untouched for the scheduler thread.
                return decode(dataclasses.replace(step, reqs=[_Rowless(r) for r in step.reqs]))

            monkeypatch.setattr(spec, "decode", decode_with_rows_cleared)
            out = engine.generate(PROMPTS, greedy())
            assert [r.token_ids for r in out] == reference
            self.assert_idle_memory_whole(engine)
