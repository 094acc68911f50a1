"""The engine thread hands a step's events to the HTTP side with one wake-up of the event
loop (`post_all`), in order, each to its request's queue."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from plugserve.sampling import SamplingParams
from plugserve.server.jobs import Event, Job, RequestHandle, post_all


def test_one_wake_up_per_step_in_order() -> None:
    async def main() -> tuple[list[Event], list[Event], int, list[RequestHandle]]:
        loop = asyncio.get_running_loop()
        wake_ups: list[Any] = []
        original = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            wake_ups.append(args)
            return original(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        jobs = [Job(None, 0.0), Job(None, 0.0)]  # type: ignore[arg-type]
        for job in jobs:
            job.handles = [RequestHandle(job, i, [1, 2], SamplingParams()) for i in range(2)]
        a, b = jobs
        posts = [(a.handles[0], Event("tokens", [5])), (b.handles[1], Event("tokens", [6])),
                 (a.handles[1], Event("tokens", [7])), (a.handles[0], Event("final", [8]))]
        # From another thread, as the engine thread does.
        worker = threading.Thread(target=post_all, args=(posts,))
        worker.start()
        worker.join()
        got_a = [await a.next_event() for _ in range(3)]
        got_b = [await b.next_event()]
        return got_a, got_b, len(wake_ups), a.handles

    got_a, got_b, wake_ups, handles = asyncio.run(main())
    assert wake_ups == 1
    assert [(e.kind, e.index, e.token_ids) for e in got_a] == [
        ("tokens", 0, [5]), ("tokens", 1, [7]), ("final", 0, [8])]
    assert [(e.kind, e.index, e.token_ids) for e in got_b] == [("tokens", 1, [6])]
    assert handles[0].final_posted and handles[0].finished
    assert not handles[1].final_posted and not handles[1].finished


def test_post_after_the_loop_closed_is_dropped() -> None:
    async def make() -> Job:
        return Job(None, 0.0)  # type: ignore[arg-type]

    job = asyncio.run(make())  # its loop is closed now
    handle = RequestHandle(job, 0, [1], SamplingParams())
    handle.post(Event("final", []))  # nobody listens: no error
    assert handle.final_posted
