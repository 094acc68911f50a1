"""Test kit: a base class for engine tests with the invariant checker on at level 1.

The invariant checker runs at level 1 with physical page checks. Subclasses declare only
their own environment overrides in `env`; they are merged down the
class hierarchy (base first, a subclass wins on the same variable) and applied for each test:

    class TestPaged(EngineTest):
        env = {"PLUGSERVE_PAGE_SIZE": "16"}

        def test_something(self, tiny_model_dir):
            with self.engine(model=str(tiny_model_dir)) as engine:
                ...

Third-party plugins use the same class: `from plugserve.testing import EngineTest`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from plugserve.engine import Engine
from plugserve.testing.memory import assert_memory_whole


class EngineTest:
    # The invariant checker at level 1 with the physical page checks, in every engine test.
    env: ClassVar[dict[str, str]] = {"PLUGSERVE_MEM_CHECK": "1", "PLUGSERVE_CHECK_PAGES": "1"}
    plugins: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def merged_env(cls) -> dict[str, str]:
        merged: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("env", {}))
        return merged

    @pytest.fixture(autouse=True)
    def _engine_env(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        for name, value in self.merged_env().items():
            monkeypatch.setenv(name, value)
        yield

    def engine(self, **overrides: Any) -> Engine:
        """An engine configured from the merged environment plus `overrides`."""
        return Engine(plugins=self.plugins, **overrides)

    @staticmethod
    def assert_idle_memory_whole(engine: Engine) -> None:
        assert_memory_whole(engine)
