"""Memory assertions for tests (the full checker lives in the checker plugin)."""

from __future__ import annotations

from typing import Any


def assert_memory_whole(engine: Any) -> None:
    """After all requests ended: `Engine.memory_problems()` finds nothing (every KV slot free,
    cached or held by a session, nothing locked but open sessions' prefixes, no page free
    twice, every request row free or session-held). Raises AssertionError naming each."""
    problems = engine.memory_problems()
    if problems:
        raise AssertionError("; ".join(problems))
