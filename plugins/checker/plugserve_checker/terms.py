"""Per-request rules the checker adds to the conservation law (DESIGN.md §3)."""

from __future__ import annotations

from plugserve.structs.req import Req


def committed_lag(req: Req) -> int | None:
    """How far a decoding request's committed length is from the KV its tokens have.

    Every token but the last has its KV written (committed); the last one's KV is written by
    the forward in flight for the request, if any, which claimed it when it was prepared.
    So committed == seq_len - 1, or seq_len with a forward in flight. Returns committed minus
    that (0 = right), or None for a request this rule does not cover (prefilling, finished).
    """
    if req.finished() or req.is_chunked or not req.output_ids:
        return None
    in_flight = 1 if req.pending_forwards > 0 else 0
    return req.kv_committed_len - (req.seq_len - 1 + in_flight)


def freed_flags_disagree(req: Req) -> bool:
    """The seed rule: a release frees the committed KV and the over-allocation together, so
    when a step ends both halves are done or neither is."""
    return req.kv_committed_freed != req.kv_overallocated_freed


def protected_misaligned(req: Req, page_size: int) -> bool:
    """The cache owns whole pages only: a request's cache-protected prefix is page-aligned
    (a policy that matched an unaligned prefix would share a page the request writes)."""
    return req.cache_protected_len % page_size != 0
