"""A request's life as the HTTP side sees it: its events and the handles that carry them.

An HTTP request becomes a `Job`: one `RequestHandle` per prompt (one engine request each),
whose events all go to the job's one asyncio queue, posted from the engine thread with
`loop.call_soon_threadsafe` (one call per step for all requests: `post_all`).

A job's `stream_interval` is how many new tokens a request gathers before the engine side
posts them (vLLM's `--stream-interval`): the first tokens and the final event go at once, and a
job that does not stream (`FINAL_ONLY`) gets no token event before its final one. Each event
is a wake-up of the HTTP side and of its client, taken from the engine's cores on a small
machine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugserve.sampling import SamplingParams

if TYPE_CHECKING:
    from plugserve.server.engine_loop import EngineLoop

FINAL_ONLY = 1 << 62  # the stream interval of a job that does not stream


@dataclass
class Event:
    kind: str  # "accepted", "tokens" or "final"
    # On "final": the engine's finish reason (stop, length, abort, error: refused at submit
    # when no "accepted" came first, else a failed generation), or "shutdown" / "failed"
    # (the loop stopped, or stopped after an engine error).
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when asked for
    # On the first event that carries tokens (or the final one): the prompt's logprobs.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    stop_str: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0  # the prompt's position in its HTTP request


class RequestHandle:
    """One engine request. `finished` belongs to the HTTP side; `req`, `sent` and
    `final_posted` to the engine thread."""

    def __init__(
        self, job: Job, index: int, ids: list[int], sampling: SamplingParams
    ) -> None:
        self.job = job
        self.index = index
        self.ids = ids
        self.sampling = sampling
        self.finished = False
        self.req: Any = None
        self.sent = 0
        self.prompt_sent = False
        self.final_posted = False
        self.key = 0  # its id in the engine process (plugserve.server.engine_process)

    @property
    def arrival_s(self) -> float:
        return self.job.arrival_s

    def post(self, event: Event) -> None:
        post_all([(self, event)])


def post_all(posts: list[tuple[RequestHandle, Event]]) -> None:
    """Hand events to their jobs' queues (from the engine thread): one wake-up of each event
    loop for all of them (a step's tokens for every running request at once)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
    for handle, event in posts:
        event.index = handle.index
        if event.kind == "final":
            handle.final_posted = True
        by_loop.setdefault(handle.job.loop, []).append((handle.job.queue, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:  # the event loop closed (server stopped): nobody is listening
            pass


def deliver(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    """On the event loop: put each event in its queue, in order."""
    for queue, event in items:
        queue.put_nowait(event)


class Job:
    """One HTTP request's engine requests (one per prompt), whose events share one queue."""

    def __init__(self, owner: EngineLoop, arrival_s: float) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival_s = arrival_s  # time.perf_counter() when the HTTP request arrived
        self.handles: list[RequestHandle] = []
        self.session: tuple[str | None, int | None] = (None, None)  # (session_id, offset)
        self.stream_interval = 1  # new tokens gathered per token event (FINAL_ONLY: none)
        self.shutting_down = False  # aborted because the server stops (not by its client)

    async def next_event(self) -> Event:
        event = await self.queue.get()
        if event.kind == "final":
            self.handles[event.index].finished = True
        return event

    @property
    def done(self) -> bool:
        return all(h.finished for h in self.handles)

    def abort(self) -> None:
        """Abort every request of the job that has not ended (a client went away)."""
        for handle in self.handles:
            if not handle.finished:
                self.owner.abort(handle)
