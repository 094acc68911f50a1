"""Streaming sessions on a hybrid sliding-window model (SWA pool): each turn's greedy output
equals the whole conversation sent as one prompt; the slot keeps `swa_evicted_seqlen`, a
rewind before the last intact window (or an aborted turn that freed it) drops the slot's KV
and the next turn recomputes; memory is whole after every turn (checker level 1, physical
checks on both pools)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts
from plugserve.testing.tiny_models import make_tiny_model_dir

TURNS = random_prompts(4, 256, 5, 20, seed=61)
OUT = 16


def _params(n: int = OUT) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@functools.cache
def _model(root: str) -> Path:
    return make_tiny_model_dir(Path(root) / "qwen3_swa", arch="qwen3_swa", seed=4)


def _plain(model: Path, history: list[int]) -> list[int]:
    with Engine(model=str(model), cache="none") as engine:
        return engine.generate([history], _params())[0].token_ids


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("swa_sessions"))


@functools.cache
def _reference(root: str) -> list[list[int]]:
    outs: list[list[int]] = []
    history: list[int] = []
    for turn in TURNS:
        history = history + turn
        outs.append(_plain(_model(root), history))
        history = history + outs[-1]
    return outs


class TestSWASessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    @pytest.mark.parametrize(("page", "overlap"), [(1, False), (16, True)])
    def test_turns_match_whole_conversation(self, root: str, page: int, overlap: bool) -> None:
        expected = _reference(root)
        with self.engine(model=str(_model(root)), page_size=page, overlap=overlap,
                         chunked_prefill_size=16) as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            sid = engine.open_session()
            for turn, want in zip(TURNS, expected, strict=True):
                (out,) = engine.generate([turn], _params(), session_id=sid)
                assert out.token_ids == want
                self.assert_idle_memory_whole(engine)
            slot = engine.kv.sessions.store.get(sid)  # type: ignore[union-attr]
            assert slot.swa_evicted_seqlen > 0  # the slot kept what its turns freed
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)

    def test_rewind_before_the_window_recomputes(self, root: str) -> None:
        with self.engine(model=str(_model(root)), page_size=4) as engine:
            sid = engine.open_session()
            engine.generate([TURNS[0]], _params(), session_id=sid)
            engine.generate([TURNS[1]], _params(), session_id=sid)
            offset = len(TURNS[0]) + 2  # long before the last window
            history = engine.kv.sessions.store.get(sid).token_ids[:offset]  # type: ignore
            (out,) = engine.generate([TURNS[2]], _params(), session_id=sid,
                                     session_offset=offset)
            assert out.token_ids == _plain(_model(root), history + TURNS[2])
            self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)

    def test_aborted_turn_leaves_the_slot_usable(self, root: str) -> None:
        expected = _reference(root)
        with self.engine(model=str(_model(root)), page_size=4, overlap=True) as engine:
            sid = engine.open_session()
            engine.generate([TURNS[0]], _params(), session_id=sid)
            req: Any = engine.submit(TURNS[1], _params(40), session_id=sid)
            for _ in range(30):  # long enough to free SWA pages of the slot's own KV
                engine.scheduler.step()
            engine.abort(req)
            engine.scheduler.run_until_idle()
            assert req.finished_reason == "abort"
            self.assert_idle_memory_whole(engine)
            (out,) = engine.generate([TURNS[1]], _params(), session_id=sid)
            assert out.token_ids == expected[1]
            self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            self.assert_idle_memory_whole(engine)


# Several conversations at once, so turns of different sessions share batches, with decodes
# mixed into prefill chunks, and with sessions that keep a cached prefix locked (their first
# turns share one).
SHARED_HEAD = random_prompts(1, 256, 24, 24, seed=71)[0]
MANY = [[SHARED_HEAD + turns[0], *turns[1:]]
        for turns in (random_prompts(3, 256, 5, 14, seed=72 + i) for i in range(3))]
# Under memory pressure: a session's turn beside two long plain requests in a small pool.
POOL = 160
PRESSURE = random_prompts(2, 256, 40, 40, seed=75)


def _conversation_reference(root: str, turns: list[list[int]]) -> list[list[int]]:
    history: list[int] = []
    outs = []
    for turn in turns:
        history = history + turn
        outs.append(_plain(_model(root), history))
        history = history + outs[-1]
    return outs


class TestManySWASessions(EngineTest):
    env = {"PLUGSERVE_CACHE": "streaming_session"}

    @pytest.mark.parametrize("case", [
        dict(page_size=4, chunked_prefill_size=16, overlap=False),
        dict(page_size=4, enable_mixed_chunk=True, chunked_prefill_size=16, overlap=False),
        dict(page_size=1, enable_mixed_chunk=True, chunked_prefill_size=8, overlap=True),
    ], ids=["chunked", "mixed", "mixed-overlap-page1"])
    def test_turns_match_whole_conversations(self, root: str, case: dict[str, Any]) -> None:
        expected = [_conversation_reference(root, turns) for turns in MANY]
        with self.engine(model=str(_model(root)), **case) as engine:
            assert [p.name for p in engine.kv.pools] == ["full", "swa"]
            engine.generate([[*SHARED_HEAD, 1]], _params(2))  # caches the shared head
            sids = [engine.open_session() for _ in MANY]
            got: list[list[list[int]]] = [[] for _ in MANY]
            for turn in range(len(MANY[0])):
                reqs = [engine.submit(turns[turn], _params(), session_id=sid)
                        for sid, turns in zip(sids, MANY, strict=True)]
                engine.scheduler.run_until_idle()
                for i, req in enumerate(reqs):
                    assert req.error is None
                    got[i].append(list(req.output_ids))
                self.assert_idle_memory_whole(engine)
                if turn == 0 and case["page_size"] > 1:
                    # The first turns matched the cached head and keep it locked, in both
                    # pools. (With page 1 window eviction frees the head's SWA KV finely
                    # enough that no window of it is left to match.)
                    assert engine.kv.session_locked_slots("swa") > 0
            assert got == expected
            for sid in sids:
                engine.close_session(sid)
            engine.scheduler.settle_idle()
            self.assert_idle_memory_whole(engine)

    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_a_retracted_turn_recomputes(self, root: str, overlap: bool) -> None:
        turns = MANY[0][:2]
        expected = _conversation_reference(root, turns)
        plain = [_plain(_model(root), p) for p in PRESSURE]
        with self.engine(model=str(_model(root)), page_size=4, kv_pool_tokens=POOL,
                         overlap=overlap) as engine:
            sid = engine.open_session()
            (first,) = engine.generate([turns[0]], _params(), session_id=sid)
            turn = engine.submit(turns[1], _params(), session_id=sid)
            others = [engine.submit(p, _params()) for p in PRESSURE]
            engine.scheduler.run_until_idle()
            assert turn.error is None and turn.retract_count > 0  # the longest prompt went first
            assert [first.token_ids, turn.output_ids] == expected
            assert [r.output_ids for r in others] == plain
            self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            engine.scheduler.settle_idle()
            self.assert_idle_memory_whole(engine)

    def test_a_decode_that_idle_sessions_starve_fails_alone(self, root: str) -> None:
        """The session's turn is retracted (its slot keeps the conversation's KV) and a plain
        request then finds no room to decode: it fails with the reason, and the engine keeps
        serving (it used to stop with 'cannot hold even one running request')."""
        turns = MANY[0][:2]
        with self.engine(model=str(_model(root)), page_size=4, kv_pool_tokens=128) as engine:
            sid = engine.open_session()
            engine.generate([turns[0]], _params(), session_id=sid)
            turn = engine.submit(turns[1], _params(), session_id=sid)
            others = [engine.submit(p, _params()) for p in PRESSURE]
            engine.scheduler.run_until_idle()
            failed = [r for r in [turn, *others] if r.error is not None]
            assert failed and all("idle streaming sessions hold" in str(r.error)
                                  for r in failed)
            self.assert_idle_memory_whole(engine)
            engine.close_session(sid)
            (again,) = engine.generate([PRESSURE[0]], _params())
            assert again.error is None and again.token_ids == _plain(_model(root), PRESSURE[0])
            self.assert_idle_memory_whole(engine)
