"""The `checker` entry point loads, registers `kv_conservation`, and its hooks are relayed.

Needs this package installed: `pip install --no-deps -e plugins/checker`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from plugserve.config import EngineConfig
from plugserve.plugins import PluginHost, get_plugin_host
from plugserve.validation import validate_config

INSTALL = "pip install --no-deps -e plugins/checker"


def _host() -> PluginHost:
    names = {ep.name for ep in entry_points(group="plugserve")}
    assert "checker" in names, f"plugserve-checker is not installed: {INSTALL}"
    return get_plugin_host(["checker"], allowlist="")


def test_entry_point_registers_checker() -> None:
    entry = _host().registries.checkers.get("kv_conservation")
    assert entry.distribution == "plugserve-checker"
    assert entry.load().__name__ == "KVConservationChecker"


def test_mem_check_is_valid_with_the_checker() -> None:
    assert validate_config(EngineConfig(mem_check=1), _host().registries) == []


def test_checker_hooks_match_the_specs() -> None:
    host = _host()
    config = EngineConfig(mem_check=1)
    checker = host.registries.checkers.get("kv_conservation").load()(config)
    pm = host.engine_hooks([checker])  # refuses unknown hooks and wrong signatures
    hooks = {caller.name for caller in pm.get_hookcallers(checker) or []}
    assert hooks >= {
        "plugserve_engine_configured",
        "plugserve_after_step",
        "plugserve_scheduler_idle",
    }
