"""Conformance kit for plugserve and its plugins (also loaded as a pytest plugin)."""

from __future__ import annotations

from typing import Any

__all__ = ["EngineTest", "assert_memory_whole"]


def __getattr__(name: str) -> Any:
    # Lazy: importing plugserve.testing (as a pytest plugin) must not import torch.
    if name == "EngineTest":
        from plugserve.testing.engine_test import EngineTest

        return EngineTest
    if name == "assert_memory_whole":
        from plugserve.testing.memory import assert_memory_whole

        return assert_memory_whole
    raise AttributeError(name)
