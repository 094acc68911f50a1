"""Placeholder for the EAGLE algorithm until its issue lands: it refuses to be built."""

from __future__ import annotations

from typing import Any


class EagleNotBuilt:
    """Stands where the EAGLE algorithm class will be; building it raises a clear error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "speculative algorithm 'eagle' is not built yet: the plugin only registers its "
            "name and capabilities so far; run without --spec (or --spec none)"
        )
