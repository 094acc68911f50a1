"""Streaming-session fix toggles: each old behaviour fails its test, the fixed code passes.

- session_double_count: a session slot lent to a running turn counted in session_held too;
  the checker reports slots counted twice (a false leak).
- session_retract_tail_leak: retracting a session turn keeps the pages the turn added past
  the session's KV; the checker reports them lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVLeakError


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


class TestSessionDoubleCount(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    def _two_turns(self, engine: Engine) -> None:
        sid = engine.open_session()
        engine.generate([[5, 6, 7, 8]], _params(6), session_id=sid)
        engine.generate([[9, 10]], _params(6), session_id=sid)  # borrows the slot
        engine.close_session(sid)
        self.assert_idle_memory_whole(engine)

    def test_fixed(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            self._two_turns(engine)

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "session_double_count")
        with self.engine(model=str(tiny_model_dir)) as engine:
            with pytest.raises(KVLeakError, match=r"session_held \d+ .*\(off by \+\d+\)"):
                self._two_turns(engine)


class TestSessionRetractTail(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_PAGE_SIZE": "4",
           "PLUGSERVE_KV_POOL_TOKENS": "240"}

    def _retracting_turns(self, engine: Engine) -> int:
        """Session turns next to long plain requests in a small pool; returns how many
        session turns were retracted."""
        sids = [engine.open_session() for _ in range(4)]
        retracted = 0
        for t in range(2):
            turns = [engine.submit([3 + s, 4 + t] * 7, _params(16), session_id=sid)
                     for s, sid in enumerate(sids)]
            plain = [engine.submit([100 + i] * 4, _params(40)) for i in range(3)]
            engine.scheduler.run_until_idle()
            assert all(r.finished_reason == "length" for r in turns + plain)
            retracted += sum(r.retract_count for r in turns)
        for sid in sids:
            engine.close_session(sid)
        self.assert_idle_memory_whole(engine)
        return retracted

    def test_fixed(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            assert self._retracting_turns(engine) > 0, "session turns must be retracted"

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "session_retract_tail_leak")
        with self.engine(model=str(tiny_model_dir)) as engine:
            with pytest.raises(KVLeakError, match=r"off by -\d+"):
                self._retracting_turns(engine)
