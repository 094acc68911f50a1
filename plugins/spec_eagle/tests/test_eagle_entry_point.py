"""The `eagle` entry point loads and registers the algorithm with its capabilities.

Needs this package installed: `pip install --no-deps -e plugins/spec_eagle`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from plugserve.config import EngineConfig
from plugserve.plugins import PluginHost, get_plugin_host
from plugserve.registry import SpecCapabilities
from plugserve.validation import validate_config

INSTALL = "pip install --no-deps -e plugins/spec_eagle"


def _host() -> PluginHost:
    names = {ep.name for ep in entry_points(group="plugserve")}
    assert "eagle" in names, f"plugserve-spec-eagle is not installed: {INSTALL}"
    return get_plugin_host(["eagle"], allowlist="")


def test_entry_point_registers_algorithm() -> None:
    entry = _host().registries.spec.get("eagle")
    assert entry.distribution == "plugserve-spec-eagle"
    assert entry.capabilities == SpecCapabilities(
        topk_gt1=True, overlap=True, needs_draft_model=True, default_draft_for_default_model=True,
        grammar=True,
    )


def test_missing_draft_model_is_a_reason_for_a_named_model() -> None:
    reasons = validate_config(EngineConfig(spec="eagle", model="some/model"), _host().registries)
    assert any("needs a draft model" in r for r in reasons), reasons


def test_the_default_model_has_a_shipped_draft_head() -> None:
    from plugserve_spec_eagle.weights import default_head_dir

    reasons = validate_config(EngineConfig(spec="eagle"), _host().registries)
    assert not any("draft model" in r for r in reasons), reasons
    assert default_head_dir().name == "smollm2-135m-instruct"


def test_loader_gives_the_algorithm() -> None:
    from plugserve.spec.base import SpecAlgorithm

    cls = _host().registries.spec.get("eagle").load()
    assert issubclass(cls, SpecAlgorithm)


def test_registers_its_fix_toggles() -> None:
    assert {"page_tree_row_widen", "prefix_tail_duplicate"} <= set(_host().fix_toggles)
