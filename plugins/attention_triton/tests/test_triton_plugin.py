"""Registration, capabilities, lazy imports and the CPU-interpreter rules."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from plugserve.attention.base import AttentionBackend
from plugserve.registry import PAGE_TREE_WHITELIST
from plugserve_attention_triton import plugin
from plugserve_attention_triton.capabilities import TRITON_CAPABILITIES

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def _run_python(code: str, **env_changes: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PLUGIN_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_hook_registers_the_triton_backend():
    calls = []

    def register(name, loader, capabilities, description=""):
        calls.append((name, loader, capabilities, description))

    plugin.plugserve_register_attention_backends(register)
    assert len(calls) == 1
    name, loader, caps, description = calls[0]
    assert name == "triton" and caps is TRITON_CAPABILITIES and description
    cls = loader()
    assert issubclass(cls, AttentionBackend) and cls.name == "triton"
    # The registration is the only source of capabilities: the class carries none.
    assert not hasattr(cls, "capabilities")


def test_capabilities_as_data():
    caps = TRITON_CAPABILITIES.as_dict()
    assert caps["devices"] == ["cpu", "cuda"]
    assert caps["dtypes"] == ["bfloat16", "float16", "float32"]
    assert caps["page_sizes"] == "any"
    assert caps["custom_mask"] and caps["topk>1"]
    assert caps["sliding_window"]
    # page_size>1 with topk>1 is the whitelist's to decide, not a capability.
    assert "page>1+topk>1" not in caps
    assert ("plugserve-attention-triton", "triton") in PAGE_TREE_WHITELIST
    assert caps["swa_slot_translation"]


def test_plugin_module_imports_no_triton():
    result = _run_python(
        "import sys, plugserve_attention_triton.plugin as p; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'plugserve_attention_triton.kernels' not in sys.modules; print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_cpu_sets_the_interpreter_when_unset():
    result = _run_python(
        "import os, torch\n"
        "from plugserve_attention_triton.runtime import prepare_triton_runtime\n"
        "k = prepare_triton_runtime(torch.device('cpu'))\n"
        "print(os.environ['TRITON_INTERPRET'], k.INTERPRETED)\n",
        TRITON_INTERPRET=None,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True"]


def test_cpu_with_interpreter_turned_off_is_a_clear_error():
    result = _run_python(
        "import torch\n"
        "from plugserve_attention_triton.runtime import prepare_triton_runtime\n"
        "prepare_triton_runtime('cpu')\n",
        TRITON_INTERPRET="0",
    )
    assert result.returncode != 0
    assert "TritonRuntimeError" in result.stderr
    assert "Set TRITON_INTERPRET=1" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_is_a_clear_error():
    from plugserve_attention_triton.runtime import TritonRuntimeError, prepare_triton_runtime

    with pytest.raises(TritonRuntimeError, match="torch sees no CUDA device"):
        prepare_triton_runtime("cuda")


def test_unknown_device_is_a_clear_error():
    from plugserve_attention_triton.runtime import TritonRuntimeError, prepare_triton_runtime

    with pytest.raises(TritonRuntimeError, match="not 'meta'"):
        prepare_triton_runtime("meta")


def test_entry_point_when_installed():
    names = {ep.name: ep.value for ep in entry_points(group="plugserve")}
    if "triton" not in names:
        pytest.skip("plugserve-attention-triton is not installed (pip install -e plugins/attention_triton)")
    assert names["triton"] == "plugserve_attention_triton.plugin"
    from plugserve.plugins import get_plugin_host

    host = get_plugin_host(refresh=True)
    assert "triton" in host.registries.attention
    entry = host.registries.attention.get("triton")
    assert entry.capabilities is TRITON_CAPABILITIES
    assert entry.capabilities_dict()["page>1+topk>1"] is True  # from the whitelist
