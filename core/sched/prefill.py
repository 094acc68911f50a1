"""The prefill adder: picks waiting requests (and the chunked one) into one extend batch.

Rules (DESIGN.md §4, applied by the KV manager): a prefill's matched prefix is page-aligned
and locked; committed = allocated = prefix + extend; a request too long for the token budget
is chunked at a page boundary, and between chunks its aligned prefix is cached as unfinished.
Every prefill, a continuing chunk too, leaves room for each running request's next decode.
A sample of an n > 1 request waits in the queue until its parent's prompt is cached, then
forks it (`KVManager.can_fork` / `fork`) and computes only the rest of its prompt.

The adder changes no scheduler state: it returns a `PrefillDecision` (the batch, the requests
it took off the waiting queue, the request whose prefill continues, a request to requeue) and
the scheduler applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from plugserve.config import EngineConfig
from plugserve.mem.manager import KVManager
from plugserve.pools.allocator import floor_align
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req
from plugserve.structs.schedule_batch import ScheduleBatch


@dataclass
class PrefillDecision:
    batch: ScheduleBatch | None  # None: no prefill runs this step
    admitted: list[Req] = field(default_factory=list)  # taken off the waiting queue, in order
    chunked_req: Req | None = None  # the request whose prefill continues in a later step
    requeued: Req | None = None  # retracted mid-prompt: back to the front of the queue
    prefill_tokens: int = 0


class PrefillAdder:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.kv = kv
        self.page_size = config.page_size
        self.budget = config.chunked_prefill_size or config.max_prefill_tokens
        self.chunking = config.chunked_prefill_size > 0
        self.max_running_requests = config.max_running_requests

    def build(
        self, waiting: Sequence[Req], chunked: Req | None, running: int, forward_in_flight: bool,
    ) -> PrefillDecision:
        """The next extend batch from the chunked request (first) and the waiting queue, with
        `running` requests decoding beside it and maybe a forward in flight (overlap loop)."""
        batch = ScheduleBatch(torch.empty(0, dtype=torch.int64), [], ForwardMode.EXTEND)
        decision = PrefillDecision(batch, chunked_req=chunked)
        budget = self.budget
        # Prompts this batch computes, so no other request computes the same long prefix.
        in_batch = _InBatchPrefixes(self.page_size)
        if chunked is not None:
            take = self._continue_chunk(decision, chunked, running, forward_in_flight)
            if take is None:
                return decision
            in_batch.add(chunked, chunked.kv_committed_len - take)
            budget -= take
            if decision.chunked_req is not None:
                batch.refresh_rows()
                return decision
        for req in waiting:
            if budget <= 0 or running + len(batch.reqs) >= self.max_running_requests:
                break
            if in_batch.computes_prefix_of(req):
                # Another request of this batch is computing the same long prefix: it waits
                # one step and reuses it from the cache instead of computing it twice.
                continue
            if self.kv.forks.pending(req):
                continue  # a sample of n > 1: it forks once its parent's prompt is cached
            if self.kv.can_fork(req):
                self.kv.fork(req)
            elif not self.kv.admit(req):
                break
            prefix_len = req.kv_committed_len
            remaining = req.seq_len - prefix_len
            if remaining <= budget:
                take, final = remaining, True
            elif self.chunking:
                take, final = floor_align(budget, self.page_size), False
            else:
                take, final = remaining, True  # no chunking: a long prompt goes alone
                if batch.reqs:
                    self.kv.unadmit(req)
                    break
            # Keep room for every running request's next decode step.
            if take <= 0 or not self.kv.can_extend(req, take, running + len(batch.reqs)):
                self.kv.unadmit(req)
                break
            decision.admitted.append(req)
            self._add(decision, req, prefix_len, take, final)
            budget -= take
            in_batch.add(req, prefix_len)
            if not final:
                req.is_chunked += 1
                decision.chunked_req = req
                break
        if batch.reqs:
            batch.refresh_rows()
        else:
            decision.batch = None
        return decision

    def _continue_chunk(
        self, decision: PrefillDecision, req: Req, running: int, forward_in_flight: bool,
    ) -> int | None:
        """The chunked request's next chunk, keeping room for every running request's next
        decode (a long prompt must not push running decodes into retract). Returns the tokens
        it takes, or None when no prefill runs this step."""
        prefix_len = req.kv_committed_len
        remaining = req.seq_len - prefix_len
        take = remaining if remaining <= self.budget else floor_align(self.budget,
                                                                      self.page_size)
        if take > 0 and self.kv.can_extend(req, take, running):
            final = take == remaining
            self._add(decision, req, prefix_len, take, final)
            if final:
                req.is_chunked = 0
                decision.chunked_req = None
            else:
                req.is_chunked += 1
            return take
        decision.batch = None
        if take > 0 and not (running or forward_in_flight):
            # Out of memory mid-prompt with nothing else running: give the chunk's KV back
            # (its cached prefix stays in the cache) and retry from the queue.
            self.kv.retract(req)
            decision.chunked_req = None
            decision.requeued = req
        # Otherwise the decodes (or the forward in flight) run first: they finish and give
        # memory back, and a request is never retracted while a forward still writes its row.
        return None

    def _add(self, decision: PrefillDecision, req: Req, prefix_len: int, extend_len: int,
             final: bool) -> None:
        batch = decision.batch
        assert batch is not None
        slots = self.kv.extend(req, extend_len)  # the room was made by can_extend
        decision.prefill_tokens += extend_len
        batch.reqs.append(req)
        batch.input_ids.extend(req.all_ids[prefix_len : prefix_len + extend_len])
        batch.positions.extend(range(prefix_len, prefix_len + extend_len))
        batch.out_cache_loc.extend(slots)
        batch.prefix_lens.append(prefix_len)
        batch.extend_lens.append(extend_len)
        batch.sample_mask.append(final)


class _InBatchPrefixes:
    """Prompts already in the batch being built, to spot a long prefix computed twice."""

    MIN_SHARED = 32  # tokens of a new, uncached shared prefix worth waiting a step for

    def __init__(self, page_size: int) -> None:
        self.key_len = max(self.MIN_SHARED, page_size)
        self.by_head: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}

    def add(self, req: Req, cached_len: int) -> None:
        ids = req.all_ids
        if len(ids) > self.key_len:
            self.by_head.setdefault(tuple(ids[: self.key_len]), []).append((ids, cached_len))

    def computes_prefix_of(self, req: Req) -> bool:
        ids = req.all_ids
        others = self.by_head.get(tuple(ids[: self.key_len]))
        if not others:
            return False
        for other, cached_len in others:
            shared = _common_prefix_len(ids[:-1], other)
            if shared - cached_len >= self.key_len:
                return True
        return False


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
