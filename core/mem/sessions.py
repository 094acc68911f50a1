"""Streaming-session slots: a conversation's row and KV kept between turns (DESIGN.md §6).

A slot owns, between turns, what its last turn committed: a `req_to_token` row, the KV of
positions `[0, kv_committed_len)` (whole pages up to `ceil_align(kv_committed_len, page)`),
and the lock on the prefix-cache node its first turn matched (`cache_protected_len`). The
next turn's request *borrows* all of it (the slot is *active* while lent) and, when the turn
ends, hands the new committed KV back. A slot that is not lent is counted in the law's
`session_held` term; an active one is not (its request counts it as uncached).

The rules that move KV in and out of slots live in the KV manager; this module is the data.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from plugserve.pools.allocator import ceil_align


class SessionError(ValueError):
    """A session request that cannot be served: unknown or closed id, busy, bad offset..."""


@dataclass
class SessionSlot:
    session_id: str
    timeout_s: float
    last_used_s: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # the conversation so far
    row: int | None = None  # the req_to_token row it owns (None before the first turn)
    kv_committed_len: int = 0  # positions of token_ids whose KV the slot holds
    cache_protected_len: int = 0  # page-aligned prefix owned and locked by the prefix cache
    last_node: Any = None  # the prefix-cache node locked for it
    turn_rid: int | None = None  # the request of the turn in progress (queued or running)
    lent: bool = False  # its row and KV are lent to that request (in a batch)
    # Hybrid sliding-window models: SWA KV below this was freed out of the window.
    swa_evicted_seqlen: int = 0

    def held_slots(self, page_size: int) -> int:
        """KV slots the slot owns outright (whole pages past the cache's prefix)."""
        if self.row is None:
            return 0
        return ceil_align(self.kv_committed_len, page_size) - self.cache_protected_len

    def held_swa_slots(self, page_size: int) -> int:
        """SWA slots the slot owns: its pages past the cache's prefix and past what fell out
        of the window."""
        if self.row is None:
            return 0
        return ceil_align(self.kv_committed_len, page_size) - max(
            self.cache_protected_len, self.swa_evicted_seqlen)


class SessionStore:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.slots: dict[str, SessionSlot] = {}
        self.count_lent_too = False  # fix toggle session_double_count (the old, wrong rule)

    def open(self, timeout_s: float, session_id: str | None = None) -> SessionSlot:
        """A new slot; `session_id` is given only by a tensor-parallel follower rank, which
        opens the session rank 0 opened under rank 0's id."""
        if not timeout_s > 0:
            raise SessionError(f"session timeout_s must be > 0 seconds, got {timeout_s!r}")
        if len(self.slots) >= self.max_sessions:
            raise SessionError(
                f"cannot open another session: {len(self.slots)} are open and each holds a "
                f"request row between turns (at most {self.max_sessions}: "
                "max_running_requests); close one or raise max_running_requests"
            )
        # unguessable: a server hands them to clients
        sid = session_id if session_id is not None else f"session-{uuid.uuid4().hex}"
        if sid in self.slots:
            raise SessionError(f"session {sid!r} is already open")
        slot = SessionSlot(sid, float(timeout_s))
        self.slots[sid] = slot
        return slot

    def get(self, session_id: object) -> SessionSlot:
        if not isinstance(session_id, str) or session_id not in self.slots:
            raise SessionError(
                f"unknown or closed session {session_id!r}; open one with open_session()"
            )
        return self.slots[session_id]

    def expired(self, now: float) -> list[SessionSlot]:
        """Idle slots (no turn in progress) past their timeout."""
        return [s for s in self.slots.values()
                if s.turn_rid is None and now - s.last_used_s > s.timeout_s]

    def held_slots(self, page_size: int) -> int:
        """The law's `session_held`: KV of slots not lent to a request in a batch."""
        return sum(s.held_slots(page_size) for s in self.slots.values()
                   if self.count_lent_too or not s.lent)

    def held_swa_slots(self, page_size: int) -> int:
        """The SWA pool's `session_held` (same rule as `held_slots`)."""
        return sum(s.held_swa_slots(page_size) for s in self.slots.values()
                   if self.count_lent_too or not s.lent)

    def held_rows(self) -> int:
        """Rows owned by slots (lent or not): at idle, free rows + these == all rows."""
        return sum(1 for s in self.slots.values() if s.row is not None)
