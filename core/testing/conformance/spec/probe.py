"""FootprintProbe: what each speculative round really writes, against the footprint the
algorithm declared and the slots the core allocated for it (docs/spec_algorithms.md).

It wraps, on one engine, the algorithm's `decode` (one round), the attention backend's
`init_forward_metadata` (every forward a round runs passes through it, with the slots it
stores at in `out_cache_loc`) and the KV pools' `set_kv` / `copy_slots` (the target's and the
algorithm's own `kv_pools`). At a round's start it reads each request's row; at its end it
checks every slot the round wrote (page 0 is the padding page: dummy writes may go there):

- it is one of the batch requests' allocated slots (row positions `[0, kv_allocated_len)`);
- with the normal loop, also its row position is in `[L, L + alloc_len_per_decode)`, L the
  request's committed length (nothing committed is overwritten, nothing past the footprint
  is touched), and the row entries past the allocated length point at a free page for the
  round's duration (they are garbage by contract), so a write past the allocation lands
  there and shows, instead of on a stale slot;
- each request emits between 1 and `alloc_len_per_decode` tokens.

Under the overlap loop the scheduler prepares the next round while one runs (allocations only
grow meanwhile, and the committed length counts pre-claims), so only the first and the last
check apply there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MAX_VIOLATIONS = 10


@dataclass
class _Round:
    number: int
    rows: list[int]
    rids: list[int]
    committed: list[int]
    slot_positions: list[dict[int, int]]  # per request: slot -> row position (allocated)
    written: set[int] = field(default_factory=set)


class FootprintProbe:
    def __init__(self, engine: Any, *, exact: bool) -> None:
        spec = engine.spec
        assert spec is not None, "the engine runs no speculative algorithm"
        self.exact = exact
        self.alloc_len = int(spec.footprint.alloc_len_per_decode)
        self.page_size = int(engine.config.page_size)
        self.rows = engine.kv.rows
        self.allocator = engine.kv.allocator
        self.rounds = 0
        self.slots_checked = 0
        self.violations: list[str] = []
        self._round: _Round | None = None
        self._wrap(spec, "decode", self._decode)
        self._wrap(engine.backend, "init_forward_metadata", self._metadata)
        pools = {id(p): p for p in [engine.kv_pool, *spec.kv_pools]}
        for pool in pools.values():
            self._wrap(pool, "set_kv", self._set_kv)
            self._wrap(pool, "copy_slots", self._copy_slots)

    @staticmethod
    def _wrap(obj: Any, name: str, wrapper: Any) -> None:
        original = getattr(obj, name)
        setattr(obj, name, lambda *args, **kwargs: wrapper(original, *args, **kwargs))

    # --- wrappers -------------------------------------------------------------------------
    def _decode(self, original: Any, step: Any) -> Any:
        self._round = self._begin(step)
        try:
            out = original(step)
            self._end(self._round, out)
            return out
        finally:
            self._round = None

    def _metadata(self, original: Any, fb: Any) -> Any:
        self._record(fb.out_cache_loc)
        return original(fb)

    def _set_kv(self, original: Any, layer_id: int, loc: torch.Tensor, *args: Any) -> Any:
        self._record(loc)
        return original(layer_id, loc, *args)

    def _copy_slots(self, original: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self._record(dst)
        return original(dst, src)

    # --- a round ----------------------------------------------------------------------------
    def _begin(self, step: Any) -> _Round:
        self.rounds += 1
        table = self.rows.req_to_token
        rows = [int(r) for r in step.forward_batch.req_pool_indices.tolist()]
        positions, committed = [], []
        for req, row in zip(step.reqs, rows, strict=True):
            allocated = int(req.kv_allocated_len)
            committed.append(int(req.kv_committed_len))
            positions.append({int(s): p for p, s in enumerate(table[row, :allocated].tolist())})
            if self.exact and self.allocator.free_pages:
                poison = self.allocator.free_pages[0] * self.page_size
                table[row, allocated:] = poison
        return _Round(self.rounds, rows, [r.rid for r in step.reqs], committed, positions)

    def _record(self, slots: torch.Tensor | None) -> None:
        if self._round is not None and slots is not None:
            self._round.written.update(int(s) for s in slots.reshape(-1).tolist()
                                       if s >= self.page_size)

    def _end(self, rnd: _Round, out: Any) -> None:
        self.slots_checked += len(rnd.written)
        for slot in sorted(rnd.written):
            owners = [(i, m[slot]) for i, m in enumerate(rnd.slot_positions) if slot in m]
            if not owners:
                self._violate(
                    f"round {rnd.number}: wrote slot {slot}, which is none of the batch "
                    "requests' allocated slots (row positions [0, kv_allocated_len)): the round "
                    "reached past its reserve (footprint too small) or into another request")
                continue
            if not self.exact:
                continue
            for i, pos in owners:
                start, end = rnd.committed[i], rnd.committed[i] + self.alloc_len
                if not start <= pos < end:
                    self._violate(
                        f"round {rnd.number}, request {rnd.rids[i]}: wrote row position {pos}, "
                        f"outside [L, L + alloc_len_per_decode) = [{start}, {end}) (L = its "
                        "committed length: committed KV is never rewritten, and the footprint "
                        "bounds what a round touches)")
        for rid, tokens in zip(rnd.rids, out.tokens, strict=True):
            if not 1 <= len(tokens) <= self.alloc_len:
                self._violate(
                    f"round {rnd.number}, request {rid}: emitted {len(tokens)} tokens; a round "
                    f"emits 1 to alloc_len_per_decode ({self.alloc_len}) (their KV lies in the "
                    "round's footprint)")

    def _violate(self, message: str) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(message)

    def assert_clean(self) -> None:
        assert self.rounds > 0, "no speculative round ran"
        assert not self.violations, "the rounds broke their footprint:\n" + "\n".join(
            self.violations)
