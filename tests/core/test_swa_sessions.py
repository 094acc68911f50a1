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
