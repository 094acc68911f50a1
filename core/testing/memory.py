"""Plain memory assertions for tests (the full checker lives in the checker plugin)."""

from __future__ import annotations

from typing import Any


def assert_memory_whole(engine: Any) -> None:
    """After all requests ended: every KV slot is free or cached, every row is free."""
    available = engine.allocator.available_size()
    evictable = engine.tree_cache.evictable_size()
    protected = engine.tree_cache.protected_size()
    total = engine.allocator.total_slots
    assert protected == 0, f"idle but {protected} cache slots are still locked"
    assert available + evictable == total, (
        f"KV leak at idle: available {available} + evictable {evictable} != total {total}"
    )
    free_pages = engine.allocator.free_pages
    assert len(free_pages) == len(set(free_pages)), "a page is in the free list twice"
    rows = engine.req_to_token_pool
    assert rows.available_rows() == rows.num_rows, (
        f"idle but {rows.num_rows - rows.available_rows()} req_to_token rows are held"
    )
