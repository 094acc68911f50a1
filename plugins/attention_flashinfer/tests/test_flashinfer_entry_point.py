"""The `flashinfer` entry point loads, registers its backend, and refuses CPU clearly.

Needs this package installed: `pip install --no-deps -e plugins/attention_flashinfer`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from plugserve.config import EngineConfig
from plugserve.plugins import PluginHost, get_plugin_host
from plugserve.registry import EntryLoadError
from plugserve.validation import validate_config

INSTALL = "pip install --no-deps -e plugins/attention_flashinfer"


def _host() -> PluginHost:
    names = {ep.name for ep in entry_points(group="plugserve")}
    assert "flashinfer" in names, f"plugserve-attention-flashinfer is not installed: {INSTALL}"
    return get_plugin_host(["flashinfer"], allowlist="")


def test_entry_point_registers_backend() -> None:
    entry = _host().registries.attention.get("flashinfer")
    assert entry.plugin == "flashinfer"
    assert entry.distribution == "plugserve-attention-flashinfer"
    assert entry.capabilities.devices == frozenset({"cuda"})
    assert "float32" not in entry.capabilities.dtypes


def test_cpu_config_is_refused_with_reason() -> None:
    config = EngineConfig(attention="flashinfer", device="cpu", dtype="bfloat16")
    reasons = validate_config(config, _host().registries)
    assert any("'flashinfer' does not run on 'cpu'" in r for r in reasons), reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_loader_says_cuda_is_required() -> None:
    with pytest.raises(EntryLoadError, match="requires CUDA"):
        _host().registries.attention.get("flashinfer").load()
