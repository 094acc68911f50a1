"""EAGLE on streaming sessions: every turn's speculative greedy output equals the whole
conversation decoded without speculation and without a session, for chain and tree drafting
with page>1 under both loops; the overlap pre-claim must be in place before a finished turn
is saved (fix toggle spec_v2_bonus_preclaim, reproduced through a session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import NUM_STEPS, greedy
from plugserve.engine import Engine
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVAccountingError

TURNS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [90, 91, 92, 93, 94, 95, 96, 97], [7]]
TURN_TOKENS = 20


@pytest.fixture(scope="module")
def plain(target_dir: Path) -> list[list[int]]:
    outputs, history = [], []
    with Engine(model=str(target_dir), dtype="float32", cache="none") as engine:
        for turn in TURNS:
            history = history + turn
            out = engine.generate([history], greedy(TURN_TOKENS))[0].token_ids
            outputs.append(out)
            history = history + out
    return outputs


class TestSpecSessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    def _turns(self, target: Path, head: Path, **kw: Any) -> list[list[int]]:
        cfg: dict[str, Any] = dict(model=str(target), dtype="float32", spec="eagle",
                                   draft_model=str(head), spec_steps=NUM_STEPS)
        cfg.update(kw)
        with self.engine(**cfg) as engine:
            sid = engine.open_session()
            outputs = []
            for turn in TURNS:
                (out,) = engine.generate([turn], greedy(TURN_TOKENS), session_id=sid)
                outputs.append(out.token_ids)
                self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)
            return outputs

    @pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
    @pytest.mark.parametrize(("page_size", "topk"), [(1, 1), (16, 1), (16, 4), (4, 2)])
    def test_lossless_turns(self, target_dir: Path, trained_head_dir: Path,
                            plain: list[list[int]], overlap: bool, page_size: int,
                            topk: int) -> None:
        extra = {"spec_draft_tokens": 6} if topk > 1 else {}
        assert self._turns(target_dir, trained_head_dir, overlap=overlap, page_size=page_size,
                           spec_topk=topk, **extra) == plain

    def test_bonus_preclaim_reverted_fails_through_a_session(
        self, target_dir: Path, trained_head_dir: Path, plain: list[list[int]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "spec_v2_bonus_preclaim")
        with pytest.raises(KVAccountingError, match=r"committed \d+ is off by -1"):
            self._turns(target_dir, trained_head_dir, overlap=True, page_size=16, spec_topk=4,
                        spec_draft_tokens=6)


class TestSavedLength(EngineTest):
    """Seed PR 22651 at the save: under the overlap loop a finished turn's committed length,
    as its session saves it, is the same with EAGLE as without speculation (the round in
    flight writes the last token's KV, as a plain decode in flight does)."""

    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_OVERLAP": "1"}

    def _saved(self, target: Path, **kw: Any) -> list[tuple[int, int]]:
        """(saved committed length, session length in tokens) after each turn."""
        with self.engine(model=str(target), dtype="float32", **kw) as engine:
            sessions = engine.kv.sessions
            assert sessions is not None
            sid = engine.open_session()
            saved = []
            for turn in TURNS:
                engine.generate([turn], greedy(TURN_TOKENS), session_id=sid)
                slot = sessions.store.get(sid)
                saved.append((slot.kv_committed_len, len(slot.token_ids)))
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)
            return saved

    def _eagle(self, target: Path, head: Path) -> list[tuple[int, int]]:
        return self._saved(target, spec="eagle", draft_model=str(head), spec_steps=NUM_STEPS,
                           page_size=16, spec_topk=4, spec_draft_tokens=6)

    def test_eagle_saves_what_plain_overlap_saves(self, target_dir: Path,
                                                  trained_head_dir: Path) -> None:
        plain = self._saved(target_dir, page_size=16)
        assert all(committed == length for committed, length in plain)
        assert self._eagle(target_dir, trained_head_dir) == plain

    def test_bonus_preclaim_reverted_saves_turns_one_short(
        self, target_dir: Path, trained_head_dir: Path, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # The checker would stop the first overlapped round (TestSpecSessions shows that);
        # off here, the save itself shows the old behaviour: a turn whose last round ended
        # exactly at its last token is saved one token short (a round that accepted past the
        # turn's end wrote that token's KV anyway).
        plain = self._saved(target_dir, page_size=16)
        monkeypatch.setenv("PLUGSERVE_MEM_CHECK", "0")
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "spec_v2_bonus_preclaim")
        saved = self._eagle(target_dir, trained_head_dir)
        assert saved != plain
        assert all(committed in (length - 1, length) for committed, length in saved), saved
        assert sum(committed == length - 1 for committed, length in saved) >= 2, saved
