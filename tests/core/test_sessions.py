"""Streaming sessions: each turn's greedy output equals the whole conversation sent as one
prompt without a session; KV is counted exactly once; rewinds, aborts, retracts, closes and
timeouts leave memory whole. The checker runs at level 1 with physical checks throughout."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.mem.sessions import SessionError
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest

TURNS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [90, 91, 92, 93, 94, 95, 96, 97, 98], [7]]
OUT = 12


def _params(n: int = OUT) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def plain_turns(model: Path, turns: list[list[int]], **kw: Any) -> list[list[int]]:
    """The reference: every turn re-sends the whole conversation, no session, no cache."""
    outputs, history = [], []
    with Engine(model=str(model), cache="none", **kw) as engine:
        for turn in turns:
            history = history + turn
            out = engine.generate([history], _params())[0].token_ids
            outputs.append(out)
            history = history + out
    return outputs


def session_turns(engine: Engine, turns: list[list[int]]) -> list[list[int]]:
    sid = engine.open_session()
    outputs = [engine.generate([t], _params(), session_id=sid)[0].token_ids for t in turns]
    engine.close_session(sid)
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    return plain_turns(tiny_model_dir, TURNS)


class TestSessionsMatchWholeConversation(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize(("page_size", "chunk", "mixed"),
                             [(1, 0, False), (16, 0, False), (4, 8, False), (16, 16, True)])
    def test_turns(self, tiny_model_dir: Path, reference: list[list[int]], page_size: int,
                   chunk: int, mixed: bool, overlap: bool) -> None:
        with self.engine(model=str(tiny_model_dir), page_size=page_size, overlap=overlap,
                         chunked_prefill_size=chunk, enable_mixed_chunk=mixed) as engine:
            sid = engine.open_session()
            computed = []
            for turn, expected in zip(TURNS, reference, strict=True):
                before = engine.stats().get("prefill_tokens", 0)
                (out,) = engine.generate([turn], _params(), session_id=sid)
                assert out.token_ids == expected
                computed.append(engine.stats()["prefill_tokens"] - before)
                self.assert_idle_memory_whole(engine)
            # A later turn computes its new tokens and the previous turn's last token only
            # (whose KV no forward wrote), plus at most the previous turn's last partial page
            # when the overlap loop already wrote it.
            for turn, n in zip(TURNS[1:], computed[1:], strict=True):
                assert len(turn) <= n <= len(turn) + 1
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)


class TestManySessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_MAX_RUNNING_REQUESTS": "20"}

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    @pytest.mark.parametrize("pool", [None, 1100], ids=["roomy", "retracts"])
    def test_sixteen_concurrent_sessions(self, tiny_model_dir: Path, overlap: bool,
                                         pool: int | None) -> None:
        """Every round runs one turn of each of 16 sessions batched together, next to plain
        requests with long outputs; with the small pool they force retracts, of session
        turns too (the sessions' own KV is never released by a retract)."""
        convs = [[[(7 * s + 3 * t + j) % 200 + 3 for j in range(4 + (s + t) % 5)]
                  for t in range(3)] for s in range(16)]
        expected = [plain_turns(tiny_model_dir, conv) for conv in convs[:4]]
        with self.engine(model=str(tiny_model_dir), overlap=overlap, page_size=4,
                         kv_pool_tokens=pool) as engine:
            sids = [engine.open_session() for _ in convs]
            outputs: list[list[list[int]]] = [[] for _ in convs]
            for t in range(3):
                reqs = [engine.submit(conv[t], _params(), session_id=sid)
                        for conv, sid in zip(convs, sids, strict=True)]
                plain = [engine.submit([100 + i] * 20, _params(60)) for i in range(4)]
                engine.scheduler.run_until_idle()
                assert all(r.finished_reason == "length" for r in plain)
                for out, req in zip(outputs, reqs, strict=True):
                    assert req.error is None and req.finished_reason == "length"
                    out.append(list(req.output_ids))
                self.assert_idle_memory_whole(engine)
            assert outputs[:4] == expected
            if pool is not None:
                assert engine.stats()["retracted_reqs"] > 0, "the small pool forces retracts"
            for sid in sids:
                engine.close_session(sid)
            self.assert_idle_memory_whole(engine)
            assert engine.kv.rows.available_rows() == engine.kv.rows.num_rows


class TestRewindAbortClose(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_PAGE_SIZE": "4"}

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_rewind_to_an_offset(self, tiny_model_dir: Path, reference: list[list[int]],
                                 overlap: bool) -> None:
        first = TURNS[0] + reference[0]
        for keep in (len(first), len(first) - 3, 6, 2, 0):  # inside the tail page, prefix...
            expected = plain_turns(tiny_model_dir, [first[:keep] + TURNS[1]])[0]
            with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
                sid = engine.open_session()
                engine.generate([TURNS[0]], _params(), session_id=sid)
                (out,) = engine.generate([TURNS[1]], _params(), session_id=sid,
                                         session_offset=keep)
                assert out.token_ids == expected, keep
                assert out.prompt_tokens == keep + len(TURNS[1])
                self.assert_idle_memory_whole(engine)
                engine.close_session(sid)
                self.assert_idle_memory_whole(engine)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_abort_mid_turn_keeps_the_previous_turn(
        self, tiny_model_dir: Path, reference: list[list[int]], overlap: bool
    ) -> None:
        with self.engine(model=str(tiny_model_dir), overlap=overlap) as engine:
            sid = engine.open_session()
            engine.generate([TURNS[0]], _params(), session_id=sid)
            doomed = engine.submit([77, 78, 79, 80, 81], _params(40), session_id=sid)
            steps = 0
            while engine.scheduler.step():
                steps += 1
                if steps == 3:
                    assert engine.abort(doomed)
            engine.scheduler.settle_idle()
            assert doomed.finished_reason == "abort" and doomed.output_ids
            self.assert_idle_memory_whole(engine)
            (out,) = engine.generate([TURNS[1]], _params(), session_id=sid)
            assert out.token_ids == reference[1]  # as if the aborted turn never happened
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)

    def test_abort_while_waiting_frees_the_session(self, tiny_model_dir: Path,
                                                   reference: list[list[int]]) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            sid = engine.open_session()
            queued = engine.submit(TURNS[0], _params(), session_id=sid)
            assert engine.abort(queued)
            (out,) = engine.generate([TURNS[0]], _params(), session_id=sid)
            assert out.token_ids == reference[0]
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)

    def test_timeout_reaps_idle_sessions(self, tiny_model_dir: Path) -> None:
        import time

        with self.engine(model=str(tiny_model_dir)) as engine:
            short = engine.open_session(timeout_s=0.05)
            engine.generate([TURNS[0]], _params(), session_id=short)
            assert engine.kv.session_held_rows() == 1
            time.sleep(0.1)
            kept = engine.open_session()  # any session call reaps first
            assert engine.kv.session_held_rows() == 0
            (gone,) = engine.generate([TURNS[1]], _params(), session_id=short)
            assert gone.finish_reason == "error" and "unknown or closed session" in gone.error
            engine.close_session(kept)
            self.assert_idle_memory_whole(engine)


class TestSessionBadInput(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session", "PLUGSERVE_MAX_RUNNING_REQUESTS": "3",
           "PLUGSERVE_CONTEXT_LEN": "64"}

    def test_each_gets_a_clear_error_and_others_are_served(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            sid = engine.open_session()
            engine.generate([TURNS[0]], _params(), session_id=sid)
            length = len(TURNS[0]) + OUT
            cases: list[tuple[dict[str, Any], str]] = [
                ({"session_id": "session-999"}, "unknown or closed session"),
                ({"session_id": sid, "session_offset": length + 1},
                 rf"session_offset must be an integer in \[0, {length}\]"),
                ({"session_id": sid, "session_offset": -1}, "session_offset must be"),
                ({"session_id": sid, "session_offset": 2.5}, "session_offset must be"),
            ]
            for kwargs, message in cases:
                good = engine.submit([3, 4, 5], _params(4))
                bad = engine.submit([50, 51], _params(4), **kwargs)
                engine.scheduler.run_until_idle()
                assert bad.finished_reason == "error"
                assert bad.error is not None and re.search(message, bad.error), bad.error
                assert good.finished_reason == "length"
            # The context holds 64 tokens: the conversation so far plus this turn is too long.
            (long,) = engine.generate([[9] * 50], _params(4), session_id=sid)
            assert long.finish_reason == "error" and "the context holds 64" in long.error
            # A second turn while the first is queued or running.
            first = engine.submit([60, 61], _params(4), session_id=sid)
            second = engine.submit([62, 63], _params(4), session_id=sid)
            assert second.finished_reason == "error"
            assert f"already has a turn in progress (request {first.rid})" in second.error
            engine.scheduler.run_until_idle()
            assert first.finished_reason == "length"
            with pytest.raises(SessionError, match="turn in progress"):
                closing = engine.submit([64], _params(4), session_id=sid)
                engine.close_session(sid)
            engine.scheduler.run_until_idle()
            assert closing.finished_reason == "length"
            # More sessions than rows.
            others = [engine.open_session() for _ in range(2)]
            with pytest.raises(SessionError, match=r"cannot open another session: 3 are open"):
                engine.open_session()
            for s in [sid, *others]:
                engine.close_session(s)
            with pytest.raises(SessionError, match="unknown or closed session"):
                engine.close_session(sid)
            self.assert_idle_memory_whole(engine)

    def test_sessions_need_a_policy_that_supports_them(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir), cache="radix") as engine:
            with pytest.raises(SessionError, match="use cache='streaming_session'"):
                engine.open_session()
            (out,) = engine.generate([[5, 6]], _params(2), session_id="session-0")
            assert out.finish_reason == "error" and "streaming_session" in out.error

    def test_sessions_holding_the_pool_fail_the_request_not_the_engine(
        self, tiny_model_dir: Path
    ) -> None:
        with self.engine(model=str(tiny_model_dir), kv_pool_tokens=48, context_len=None,
                         max_running_requests=4) as engine:
            sids = [engine.open_session() for _ in range(2)]
            for sid in sids:
                engine.generate([[5, 6, 7, 8, 9, 10]], _params(14), session_id=sid)
            (starved,) = engine.generate([[3] * 20], _params(8))
            assert starved.finish_reason == "error"
            assert "idle streaming sessions hold" in (starved.error or "")
            engine.close_session(sids[0])
            (served,) = engine.generate([[3] * 20], _params(8))
            assert served.finish_reason == "length"
            engine.close_session(sids[1])
            self.assert_idle_memory_whole(engine)
