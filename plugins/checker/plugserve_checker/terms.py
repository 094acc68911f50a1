"""The terms of the conservation law for one pool, busy or idle (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugserve import fixes
from plugserve.mem.accounting import AccountedPool
from plugserve.sched.req import Req


@dataclass(frozen=True)
class PoolTerms:
    pool: str
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int
    total: int

    @property
    def balance(self) -> int:
        """Zero when the law holds; > 0 = slots counted twice, < 0 = slots lost."""
        return (
            self.available + self.evictable + self.protected + self.session_held + self.uncached
            - self.total
        )

    def describe(self) -> str:
        return (
            f"pool {self.pool!r}: available {self.available} + evictable {self.evictable} + "
            f"protected {self.protected} + session_held {self.session_held} + uncached "
            f"{self.uncached} = {self.total + self.balance}, total {self.total} "
            f"(off by {self.balance:+d})"
        )


def batches_to_count(scheduler: Any) -> list[Any]:
    """The last batch, and the running batch when it is a *different object* and non-empty."""
    last = scheduler.last_batch
    running = scheduler.running_batch
    out = [last] if last is not None else []
    if running is None or running.is_empty():
        return out
    if fixes.reverted("batch_identity"):
        separate = last is None or running != last  # old: field-by-field equality
    else:
        separate = running is not last
    if separate:
        out.append(running)
    return out


def live_reqs(batches: list[Any]) -> list[Req]:
    """Requests of the batches that still hold a row (finished-and-released ones do not)."""
    return [req for batch in batches for req in batch.reqs if req.req_pool_idx is not None]


def busy_terms(pool: AccountedPool, reqs: list[Req]) -> PoolTerms:
    return PoolTerms(
        pool=pool.name,
        available=pool.allocator.available_size(),
        evictable=pool.evictable_size(),
        protected=pool.protected_size(),
        session_held=pool.session_held(),
        uncached=sum(pool.req_uncached(req) for req in reqs),
        total=pool.total,
    )


def idle_terms(pool: AccountedPool) -> PoolTerms:
    return busy_terms(pool, [])


def committed_lag(req: Req) -> int | None:
    """How far a decoding request's committed length is from the KV its tokens have.

    Every token but the last has its KV written (committed); the last one's KV is written by
    the forward in flight for the request, if any, which claimed it when it was prepared.
    So committed == seq_len - 1, or seq_len with a forward in flight. Returns committed minus
    that (0 = right), or None for a request this rule does not cover (prefilling, finished).
    """
    if req.finished() or req.is_chunked or not req.output_ids:
        return None
    in_flight = 1 if req.extra.get("pending_forwards", 0) > 0 else 0
    return req.kv_committed_len - (req.seq_len - 1 + in_flight)
