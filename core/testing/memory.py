"""Plain memory assertions for tests (the full checker lives in the checker plugin)."""

from __future__ import annotations

from typing import Any


def assert_memory_whole(engine: Any) -> None:
    """After all requests ended: in every pool each KV slot is free, cached or held by a
    session, nothing is locked but open sessions' prefixes, no page is free twice, and every
    request row is free (or session-held)."""
    kv = engine.kv
    for pool in kv.pools:
        terms = pool.terms([])
        # Open streaming sessions keep their first turn's cached prefix locked between turns.
        session_locked = kv.session_locked_slots(pool.name)
        assert terms.protected == session_locked, (
            f"idle but {terms.protected} slots of pool {pool.name!r} are still locked by "
            f"the cache ({session_locked} by open sessions)"
        )
        assert terms.balance == 0, f"KV leak at idle: {terms.describe()}"
        free_pages = pool.allocator.free_pages
        assert len(free_pages) == len(set(free_pages)), (
            f"a page of pool {pool.name!r} is in the free list twice"
        )
    problem = kv.rows_problem()
    assert problem is None, f"idle but {problem}"
