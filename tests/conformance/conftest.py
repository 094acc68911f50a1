"""Fixtures of the conformance-suite tests: the docs' example backend and its broken doubles,
registered in-process as if their plugins were installed (and the same for the cache-policy
example and the broken cache policies and speculative algorithms: `cache_plugins`,
`spec_plugins`).

`example_plugins` serves two extra entry points in group "plugserve" next to the real ones:
`example` (docs/examples/attention_example, registering the "example" backend) and
`broken_examples` (broken_backends.py, registering one broken variant per bug). Plugin hosts
are rebuilt before and after, so no other test sees them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXAMPLE_ROOT = HERE.parents[1] / "docs" / "examples" / "attention_example"
for folder in (EXAMPLE_ROOT, HERE):  # the example package and the doubles, importable
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
# The cache-policy example package and its own tests (test_cache_example.py imports them).
CACHE_EXAMPLE_ROOT = HERE.parents[1] / "docs" / "examples" / "cache_example"
for folder in (CACHE_EXAMPLE_ROOT, CACHE_EXAMPLE_ROOT / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def install_plugins(monkeypatch: pytest.MonkeyPatch, **modules: str) -> None:
    """Serve `name=module` as extra installed plugins (entry points in group "plugserve")."""
    from importlib.metadata import EntryPoint

    import plugserve.plugins as plugins_module

    real = plugins_module.installed_entry_points()
    extra = [EntryPoint(name=name, value=module, group="plugserve")
             for name, module in modules.items()]
    eps = sorted([*real, *extra], key=lambda ep: ep.name)
    monkeypatch.setattr(plugins_module, "installed_entry_points", lambda: list(eps))
    monkeypatch.delenv("PLUGSERVE_PLUGINS", raising=False)
    plugins_module.clear_plugin_hosts()


@pytest.fixture
def example_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from plugserve.plugins import clear_plugin_hosts

    install_plugins(monkeypatch, example="plugserve_attention_example.plugin",
                    broken_examples="broken_backends")
    yield
    clear_plugin_hosts()


@pytest.fixture
def cache_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`lru_radix` (docs/examples/cache_example) and the broken policies of broken_caches.py."""
    from plugserve.plugins import clear_plugin_hosts

    install_plugins(monkeypatch, lru_radix="plugserve_cache_example.plugin",
                    broken_caches="broken_caches")
    yield
    clear_plugin_hosts()


@pytest.fixture
def spec_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The broken speculative algorithms of broken_specs.py."""
    from plugserve.plugins import clear_plugin_hosts

    install_plugins(monkeypatch, broken_specs="broken_specs")
    yield
    clear_plugin_hosts()


@pytest.fixture
def grammar_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy grammar backends of toy_grammars.py (one correct, one with a planted bug)."""
    from plugserve.plugins import clear_plugin_hosts

    install_plugins(monkeypatch, toy_grammars="toy_grammars")
    yield
    clear_plugin_hosts()
