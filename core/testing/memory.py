"""Plain memory assertions for tests (the full checker lives in the checker plugin)."""

from __future__ import annotations

from typing import Any


def assert_memory_whole(engine: Any) -> None:
    """After all requests ended: in every pool each KV slot is free or cached, nothing is
    locked, no page is free twice, and every request row is free (or session-held)."""
    kv = engine.kv
    for pool in kv.pools:
        terms = pool.terms([])
        assert terms.protected == 0, (
            f"idle but {terms.protected} slots of pool {pool.name!r} are still locked by the cache"
        )
        assert terms.balance == 0, f"KV leak at idle: {terms.describe()}"
        free_pages = pool.allocator.free_pages
        assert len(free_pages) == len(set(free_pages)), (
            f"a page of pool {pool.name!r} is in the free list twice"
        )
    problem = kv.rows_problem()
    assert problem is None, f"idle but {problem}"
