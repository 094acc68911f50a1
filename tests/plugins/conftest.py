"""Fixtures of the plugin-system tests: a clean plugin cache, and the dummy plugins.

The dummy plugin packages must be installed first: `bash tests/dummy_plugins/install.sh`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dummy_plugins"))
from plugin_fixtures import dummy_plugins, fresh_plugin_hosts  # noqa: F401 (fixtures)


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make in-process objects the only installed plugins: `fake_plugins(name=obj, ...)`.

    Each object is served as the module an entry point `name` in group "plugserve" points to,
    so it goes through exactly the loading path of a real plugin (no distribution metadata).
    """
    from importlib.metadata import EntryPoint

    import plugserve.plugins as plugins_module

    def install(**plugins: object) -> None:
        eps = []
        for name, plugin in plugins.items():
            module_name = f"plugserve_test_fake_{name}"
            # A real module, as an entry point loads (pluggy keeps plugins in sets).
            module = types.ModuleType(module_name)
            module.__dict__.update(vars(plugin))
            monkeypatch.setitem(sys.modules, module_name, module)
            eps.append(EntryPoint(name=name, value=module_name, group="plugserve"))
        eps.sort(key=lambda ep: ep.name)
        monkeypatch.setattr(plugins_module, "installed_entry_points", lambda: list(eps))

    return install
