"""The `fa3` entry point loads, registers its backend, and refuses CPU and fp32 clearly.

Needs this package installed: `pip install --no-deps -e plugins/attention_fa3`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from plugserve.config import EngineConfig
from plugserve.plugins import PluginHost, get_plugin_host
from plugserve.registry import EntryLoadError
from plugserve.validation import validate_config

INSTALL = "pip install --no-deps -e plugins/attention_fa3"


def _host() -> PluginHost:
    names = {ep.name for ep in entry_points(group="plugserve")}
    assert "fa3" in names, f"plugserve-attention-fa3 is not installed: {INSTALL}"
    return get_plugin_host(["fa3"], allowlist="")


def test_entry_point_registers_backend() -> None:
    entry = _host().registries.attention.get("fa3")
    assert entry.plugin == "fa3"
    assert entry.distribution == "plugserve-attention-fa3"
    assert entry.capabilities.devices == frozenset({"cuda"})
    assert entry.capabilities.dtypes == frozenset({"bfloat16", "float16"})


def test_cpu_fp32_config_is_refused_with_every_reason() -> None:
    config = EngineConfig(attention="fa3", device="cpu", dtype="float32")
    reasons = validate_config(config, _host().registries)
    assert any("'fa3' does not run on 'cpu'" in r for r in reasons), reasons
    assert any("does not support dtype 'float32'" in r for r in reasons), reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_loader_says_cuda_is_required() -> None:
    with pytest.raises(EntryLoadError, match="requires CUDA"):
        _host().registries.attention.get("fa3").load()
