"""Engine.stream gives every request of the call exactly one final event, however it ended:
finished, aborted while waiting, aborted while running, or rejected at submit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine, StreamEvent
from plugserve.sampling import SamplingParams
from plugserve.structs.req import Req
from plugserve.testing import EngineTest

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _spy_submit(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, after: Callable[[int, Req], None] | None = None
) -> list[Req]:
    """Record the requests stream() submits (it does not hand them out), optionally acting on
    each right after its submit."""
    reqs: list[Req] = []
    real = engine.submit

    def submit(prompt: Any, sampling: Any = None, *, chat: bool = False, **session: Any) -> Req:
        req = real(prompt, sampling, chat=chat, **session)
        reqs.append(req)
        if after is not None:
            after(len(reqs) - 1, req)
        return req

    monkeypatch.setattr(engine, "submit", submit)
    return reqs


def _check_finals(events: list[StreamEvent], n: int) -> dict[int, Any]:
    """Exactly one final event per request, last for that request, carrying a result whose
    tokens are the ones streamed."""
    finals = [e for e in events if e.finished]
    assert sorted(e.index for e in finals) == list(range(n)), [
        (e.index, e.finished) for e in events
    ]
    out = {}
    for e in finals:
        assert e.result is not None
        mine = [x for x in events if x.index == e.index]
        assert mine[-1] is e
        assert [t for x in mine for t in x.token_ids] == e.result.token_ids
        out[e.index] = e.result
    return out


class TestStreamAbort(EngineTest):
    def test_abort_right_after_submit(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            aborted: list[bool] = []

            def abort_second(i: int, req: Req) -> None:
                if i == 1:
                    aborted.append(engine.abort(req))

            _spy_submit(engine, monkeypatch, abort_second)
            events = list(engine.stream([[5, 6, 7], [8, 9, 10]], SP))
            assert aborted == [True]
            results = _check_finals(events, 2)
            assert results[0].finish_reason == "length" and len(results[0].token_ids) == 4
            assert results[1].finish_reason == "abort" and results[1].token_ids == []
            assert engine.scheduler.is_idle()
            self.assert_idle_memory_whole(engine)

    def test_abort_while_waiting_from_inside_the_iteration(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # One running slot: the second request waits while the first one runs.
        with self.engine(model=str(tiny_model_dir), max_running_requests=1) as engine:
            reqs = _spy_submit(engine, monkeypatch)
            events: list[StreamEvent] = []
            for event in engine.stream([[5, 6, 7], [8, 9, 10]], SP):
                events.append(event)
                if len(events) == 1:
                    assert event.index == 0 and not event.finished
                    waiting = reqs[1]
                    assert waiting.req_pool_idx is None and not waiting.output_ids
                    assert engine.abort(waiting)
            results = _check_finals(events, 2)
            assert results[0].finish_reason == "length" and len(results[0].token_ids) == 4
            assert results[1].finish_reason == "abort" and results[1].token_ids == []
            assert engine.scheduler.is_idle()
            self.assert_idle_memory_whole(engine)

    def test_every_way_of_ending(
        self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # 0 is aborted while running, 1 finishes, 2 is rejected at submit (empty prompt),
        # 3 is aborted while waiting (two running slots, taken by 0 and 1).
        prompts = [[5, 6, 7], [8, 9, 10], [], [11, 12, 13]]
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir), max_running_requests=2) as engine:
            reqs = _spy_submit(engine, monkeypatch)
            events: list[StreamEvent] = []
            for event in engine.stream(prompts, sp):
                events.append(event)
                if event.index == 0 and not event.finished and len(event.token_ids) > 0:
                    if reqs[0].finished():
                        continue
                    assert reqs[3].req_pool_idx is None  # still waiting
                    assert engine.abort(reqs[0])
                    assert engine.abort(reqs[3])
            results = _check_finals(events, 4)
            assert results[0].finish_reason == "abort"
            assert 1 <= len(results[0].token_ids) < 6
            assert results[1].finish_reason == "length" and len(results[1].token_ids) == 6
            assert results[2].finish_reason == "error" and results[2].error == "prompt is empty"
            assert results[3].finish_reason == "abort" and results[3].token_ids == []
            assert engine.scheduler.is_idle()
            self.assert_idle_memory_whole(engine)
