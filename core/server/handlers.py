"""One generation request, from its body to its response (full JSON or an SSE stream).

Check what can be checked without the engine (400 / 413, whatever the load), submit (503
when the waiting queue is full), wait until the engine accepted or refused every prompt (a
refusal is a 400, or 413 for a prompt over the context, and aborts the others), then either collect every choice while watching for a disconnect, or stream. A
client that goes away aborts whatever it still had running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from plugserve.server.engine_loop import EngineLoop, NotServing, Overloaded
from plugserve.server.errors import APIError, engine_rejection
from plugserve.server.jobs import FINAL_ONLY, Event, Job
from plugserve.server.output import Choice, Delta, Documents, best_choices
from plugserve.server.sampling import Generation, check_samples, fit_to_context, precheck
from plugserve.server.sessions import SessionOwners, caller_key
from plugserve.server.settings import ServerSettings

log = logging.getLogger("plugserve.server")
SERVED = ("stop", "length")


class ServerState:
    def __init__(self, loop: EngineLoop, settings: ServerSettings, model_id: str,
                 aliases: tuple[str, ...] = ()) -> None:
        self.loop = loop
        self.settings = settings
        self.model_id = model_id
        self.aliases = frozenset((model_id, *aliases))
        self.tokenizer = loop.tokenizer
        self.context_len = loop.context_len
        self.jobs: set[Job] = set()  # generation requests answering now (shutdown waits on them)
        self.draining = False  # shutting down: new generation requests get a 503
        self.session_owners = SessionOwners()
        self.aborted_for_shutdown = 0

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.aliases:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_id!r} (GET /v1/models)",
                           param="model", code="model_not_found")

    def submit(self, gen: Generation, arrival_s: float, *, stream: bool) -> Job:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           headers={"Connection": "close"})
        if len(gen.prompts) > self.settings.max_waiting:
            raise APIError(400, f"{len(gen.prompts)} prompts in one request; at most "
                                f"{self.settings.max_waiting} (the waiting-queue limit)",
                           param="prompt")
        try:
            return self.loop.submit(gen.prompts, gen.sampling, arrival_s,
                                    session=(gen.session_id, gen.session_offset),
                                    stream_interval=self.stream_interval(gen, stream))
        except Overloaded as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except NotServing as exc:
            raise APIError(503, str(exc)) from None

    def stream_interval(self, gen: Generation, stream: bool) -> int:
        """New tokens per token event: the server's --stream-interval, raised by the
        request's own; a request that does not stream needs only its final event."""
        if not stream:
            return FINAL_ONLY
        return max(self.settings.stream_interval, gen.stream_interval or 1)

    async def respond(self, request: Request, gen: Generation, docs: Documents, *,
                      stream: bool, include_usage: bool, stop: tuple[str, ...],
                      arrival_s: float) -> Response:
        if gen.session_id is not None:
            self.session_owners.check(gen.session_id, caller_key(request))
        check_samples(gen, self.settings.max_n, stream)
        precheck(gen, self.loop.vocab_size, self.context_len)
        gen = fit_to_context(gen, self.context_len)
        await self._compile_grammar(gen)
        job = self.submit(gen, arrival_s, stream=stream)
        self.jobs.add(job)
        sp = gen.sampling
        per_prompt = sp.num_samples  # choice i * per_prompt + j: sample j of prompt i
        choices = [Choice(i * per_prompt + j, docs.render, stop, sp.include_stop_str_in_output,
                          keep_tokens=not gen.drop_output, prompt_ids=ids,
                          counts_prompt=j == 0)
                   for i, ids in enumerate(gen.prompts) for j in range(per_prompt)]
        handed_off = False
        try:
            early = await self._accepted(job, gen)
            if stream:
                handed_off = True
                from plugserve.server.sse import SSEResponse

                def closed() -> None:
                    job.abort()
                    self.jobs.discard(job)

                return SSEResponse(self._chunks(job, choices, docs, include_usage, early),
                                   on_close=closed)
            return await self._complete(request, job, choices, docs, early, gen)
        finally:
            if not handed_off:
                job.abort()
                self.jobs.discard(job)

    async def _compile_grammar(self, gen: Generation) -> None:
        """Compile the request's grammar (cached; on the grammar service's own thread) before
        it queues: an invalid schema, regex or grammar is a 400 naming the field, and the
        engine finds it compiled."""
        spec = gen.sampling.structured_outputs
        if spec is None:
            return
        from plugserve.grammar.base import GrammarError

        param = gen.grammar_param or "structured_outputs"
        try:
            await asyncio.wrap_future(self.loop.compile_grammar(spec))
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def abort_for_shutdown(self) -> int:
        """The grace period is over: end every generation still running (streams get a last
        chunk with finish_reason "abort", others a 503). The number of requests aborted."""
        count = 0
        for job in list(self.jobs):
            if not job.done:
                job.shutting_down = True
                count += sum(1 for h in job.handles if not h.finished)
                job.abort()
        self.aborted_for_shutdown += count
        return count

    async def _accepted(self, job: Job, gen: Generation) -> list[Event]:
        """Wait until each prompt was accepted or refused; the token events met meanwhile."""
        early: list[Event] = []
        pending = len(job.handles)
        refused: Event | None = None
        while pending:
            event = await job.next_event()
            if event.kind == "accepted":
                pending -= 1
            elif event.kind == "final" and not _was_accepted(early, event.index):
                pending -= 1
                refused = refused or event
                continue
            early.append(event)
        if refused is not None:
            job.abort()
            prompt = gen.prompts[refused.index // gen.sampling.num_samples]
            raise self._failure(refused, len(prompt), accepted=False)
        return early

    def _failure(self, event: Event, prompt_tokens: int, *, accepted: bool) -> APIError:
        reason, error = event.finish_reason, event.error or "request ended"
        if reason == "error" and not accepted:
            return engine_rejection(error, prompt_tokens, self.context_len)
        if reason == "error":
            return APIError(500, f"generation failed: {error}")
        if reason == "failed":
            return APIError(500, error)
        return APIError(503, "the server shut down before the request finished; retry later")

    async def _complete(self, request: Request, job: Job, choices: list[Choice],
                        docs: Documents, early: list[Event], gen: Generation) -> Response:
        for event in early:
            choices[event.index].add(event)

        async def collect() -> None:
            while not job.done:
                event = await job.next_event()
                choices[event.index].add(event)

        collecting = asyncio.ensure_future(collect())
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
        if not collecting.done() or collecting.cancelled():
            job.abort()  # the client went away: nobody reads the answer
            return Response(status_code=499)
        collecting.result()
        for choice in choices:
            if choice.finish_reason not in SERVED:
                raise self._failure(_final_of(choice), choice.prompt_tokens, accepted=True)
        return JSONResponse(docs.full(best_choices(choices, gen.sampling.n,
                                                   gen.sampling.num_samples)))

    async def _chunks(self, job: Job, choices: list[Choice], docs: Documents,
                      include_usage: bool, early: list[Event]) -> AsyncIterator[dict[str, Any]]:
        if docs.chat:
            for choice in choices:
                yield docs.chunk(choice, Delta("", [], [], None), None, role=True)
        echoed = [not docs.echo] * len(choices)
        while early or not job.done:
            event = early.pop(0) if early else await job.next_event()
            choice = choices[event.index]
            delta = choice.add(event)
            if not echoed[event.index] and (event.token_ids or event.kind == "final"):
                echoed[event.index] = True
                yield docs.echo_chunk(choice)
            if event.kind == "final":
                if choice.finish_reason == "abort" and job.shutting_down:
                    yield docs.chunk(choice, delta, "abort")  # the server stopped it
                    continue
                if choice.finish_reason not in SERVED:
                    job.abort()
                    failure = self._failure(event, choice.prompt_tokens, accepted=True)
                    yield failure.document()
                    return
                yield docs.chunk(choice, delta, choice.finish_reason)
            elif delta.text or (delta.token_ids and (docs.want_token_ids
                                                     or docs.want_logprobs)):
                yield docs.chunk(choice, delta, None)
        if include_usage:
            yield docs.usage_chunk(choices)


def _was_accepted(early: list[Event], index: int) -> bool:
    return any(e.index == index for e in early)


def _final_of(choice: Choice) -> Event:
    return Event("final", [], finish_reason=choice.finish_reason,
                 error=choice.error or f"request ended: {choice.finish_reason}",
                 index=choice.index)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
