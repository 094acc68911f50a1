"""Fixtures shared by the CLI and plugin-system tests (their conftests import them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dummy_site
import pytest


@pytest.fixture(autouse=True)
def fresh_plugin_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test loads plugins anew, with no allowlist unless it sets one."""
    from plugserve.plugins import clear_plugin_hosts

    monkeypatch.delenv("PLUGSERVE_PLUGINS", raising=False)
    clear_plugin_hosts()
    yield
    clear_plugin_hosts()


@pytest.fixture
def dummy_plugins() -> Iterator[Path]:
    """The dummy plugin packages, importable for the test's duration."""
    with dummy_site.activated() as site:
        yield site
