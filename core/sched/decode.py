"""The decode manager: room for the next decode, retract, and the decode batch's layout
(DESIGN.md §4, §5).

Before a decode forward runs, each request claims the slot it writes (committed += 1,
allocated += 1), or, with speculative decoding, tops up its round's reserve (the KV manager's
`spec.prepare_round`). When the pool cannot give every request its slots, the cache is evicted
first; under the overlap loop the forward in flight is then resolved (finished requests give
their memory back only then); only then are victims retracted: their KV is released without
being cached, their lengths reset, and the scheduler requeues them at the front.
"""

from __future__ import annotations

from collections.abc import Callable

from plugserve.mem.manager import KVManager
from plugserve.structs.forward_batch import ForwardMode
from plugserve.structs.req import Req
from plugserve.structs.schedule_batch import ScheduleBatch

NextInputToken = Callable[[Req], int]


class DecodeManager:
    def __init__(self, kv: KVManager, page_size: int) -> None:
        self.kv = kv
        self.page_size = page_size

    def retract_until_room(self, batch: ScheduleBatch) -> tuple[list[Req], Req | None]:
        """Retract victims until every remaining request of `batch` has its next slots (the
        KV manager evicts from the cache first). Returns the retracted requests and, when
        even the last one cannot go on because idle streaming sessions hold the memory, that
        request with its error set (it fails alone); both are removed from `batch`. Under the
        overlap loop the scheduler resolves the forward in flight before it calls this: a
        request is never retracted while a forward writes it."""
        kv = self.kv
        retracted: list[Req] = []
        # Victims: fewest decoded tokens first, and among those the longest prompt, so the
        # most decoded requests with the shortest prompts are retracted last.
        order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)),
                       reverse=True)
        while len(order) > 1 and not kv.can_decode(order):
            victim = order.pop()
            kv.retract(victim)
            retracted.append(victim)
        failed = None
        if order and not kv.can_decode(order):
            why = kv.idle_sessions_in_the_way()
            if why is None:
                raise RuntimeError(
                    f"KV pool cannot hold even one running request ({order[0]}, needs "
                    f"{kv.decode_pages_needed(order)} more page(s) of {self.page_size}; "
                    f"{kv.capacity()}); raise kv_pool_tokens"
                )
            failed = order.pop()
            failed.error = why
        if retracted or failed is not None:
            keep = set(map(id, order))
            batch.reqs = [r for r in batch.reqs if id(r) in keep]
        return retracted, failed

    def prepare(self, batch: ScheduleBatch, next_input_token: NextInputToken) -> None:
        """Claim every request's next slots (after `make_room`) and lay out the decode."""
        batch.mode = ForwardMode.DECODE
        batch.input_ids, batch.positions, batch.out_cache_loc = [], [], []
        batch.prefix_lens, batch.extend_lens, batch.sample_mask = [], [], []
        if self.kv.spec is not None:
            self._lay_out_spec_rounds(batch)
        else:
            self.append(batch, batch.reqs, next_input_token)
        batch.refresh_rows()

    def append(self, batch: ScheduleBatch, reqs: list[Req],
               next_input_token: NextInputToken) -> None:
        """Claim the slot each request's next forward writes and append its one-token layout
        (a decode batch, or the decodes of a mixed batch)."""
        for req in reqs:
            pos = req.kv_allocated_len
            batch.out_cache_loc.append(self.kv.claim_decode(req))
            batch.input_ids.append(next_input_token(req))
            batch.positions.append(pos)
            batch.prefix_lens.append(pos)
            batch.extend_lens.append(1)
            batch.sample_mask.append(True)

    def _lay_out_spec_rounds(self, batch: ScheduleBatch) -> None:
        """Top up every request's reserve (pre-claim under overlap); the round itself runs in
        the speculative algorithm, which reads its own state, not these inputs."""
        spec = self.kv.spec
        assert spec is not None
        for req in batch.reqs:
            spec.prepare_round(req)
            batch.input_ids.append(0)
            batch.positions.append(req.kv_committed_len)
            batch.prefix_lens.append(req.kv_committed_len)
            batch.extend_lens.append(1)
            batch.sample_mask.append(True)
