"""The events of one `Engine.stream` call: for each request (each sample of an n > 1 one),
the tokens and text the events have carried so far, and exactly one final event however
the request ended."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from plugserve.detokenize import IncrementalText
from plugserve.outputs import StreamEvent, generate_result
from plugserve.structs.req import Req


class StreamTracker:
    def __init__(self, parents: list[Req], decode: Callable[[list[int]], str]) -> None:
        # Every sample of every prompt, with its prompt's index.
        self.index = [i for i, p in enumerate(parents) for _ in p.group]
        self.reqs = [r for p in parents for r in p.group]
        self._decode = decode
        self._tokens_sent = [0] * len(self.reqs)
        self._done = [False] * len(self.reqs)
        # Each request's text as its tokens arrive (a few tokens decoded per event), and how
        # many characters of it the events have carried: a character split across tokens
        # comes whole.
        self._running = [IncrementalText(decode) for _ in self.reqs]
        self._chars_sent = [0] * len(self.reqs)

    def after_step(self) -> Iterator[StreamEvent]:
        """An event for each request with new tokens, or that ended, since the last call."""
        for k, req in enumerate(self.reqs):
            if self._done[k]:
                continue
            # Final once its KV is released, or when it never held any: rejected at submit,
            # or aborted while waiting (no row, nothing to release).
            final = req.finished() and (
                req.finish_released or req.error is not None or req.req_pool_idx is None
            )
            if len(req.output_ids) > self._tokens_sent[k] or final:
                yield self._event(k, req, final)

    def finish_all(self) -> Iterator[StreamEvent]:
        """Final events for the requests that have none yet (the scheduler is idle: whatever
        is left has ended, with or without a release seen)."""
        for k, req in enumerate(self.reqs):
            if not self._done[k]:
                yield self._event(k, req, True)

    def _event(self, k: int, req: Req, final: bool) -> StreamEvent:
        new = req.output_ids[self._tokens_sent[k]:]
        self._tokens_sent[k] += len(new)
        self._done[k] = final
        result = None
        if final:
            result = generate_result(self.index[k], req, self._decode)
            if not req.logprobs_asked:
                result.logprobs = None
            text = self._decode(list(req.output_ids))  # the whole output, decoded once
        else:
            text = self._running[k].text(req.output_ids).rstrip("\ufffd")
        piece = text[self._chars_sent[k]:]
        self._chars_sent[k] = max(self._chars_sent[k], len(text))
        return StreamEvent(self.index[k], new, piece, final, result,
                           sample_index=req.sample_index)
