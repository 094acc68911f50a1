"""Registration: capabilities with the not-verified note, the fix toggle, lazy imports, and
a backend that refuses to run FlashInfer's CUDA kernels anywhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugserve.attention.capabilities import gpu_verification_note
from plugserve.attention.whitelist import whitelisted_for_page_tree
from plugserve.testing.paged_cases import Shape
from plugserve_attention_flashinfer import capabilities, plugin
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend
from plugserve_attention_flashinfer.environment import unavailable_reason
from plugserve_attention_flashinfer.fixes import DRAFT_INDICES_TOPK_FACTOR, SHARED_PREFILL_WRAPPER

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def test_hook_registers_the_backend_with_its_capabilities() -> None:
    calls = []
    plugin.plugserve_register_attention_backends(
        lambda name, loader, caps, description="", availability=None: calls.append(
            (name, caps, description, availability)))
    assert len(calls) == 1
    name, caps, description, availability = calls[0]
    assert name == "flashinfer" and caps is capabilities.CAPABILITIES and description
    assert availability is unavailable_reason
    assert caps.devices == frozenset({"cuda"})
    assert caps.custom_mask and caps.topk_gt1 and caps.sliding_window
    assert not caps.swa_slot_translation  # one plain pool with a window mask
    assert whitelisted_for_page_tree("plugserve-attention-flashinfer", "flashinfer")


def test_not_verified_until_a_gpu_run_says_so() -> None:
    assert capabilities.VERIFIED_ON is None
    assert capabilities.CAPABILITIES.notes[0] == (
        "not verified on a GPU yet: run "
        "`plugserve conformance --attention flashinfer --device cuda`")
    assert gpu_verification_note("flashinfer", "H200, 2026-11-23, conformance") == (
        "verified on a GPU: H200, 2026-11-23, conformance")


def test_hook_registers_the_fix_toggles() -> None:
    names = []
    plugin.plugserve_register_fix_toggles(lambda name, description: names.append(name))
    assert names == [DRAFT_INDICES_TOPK_FACTOR, SHARED_PREFILL_WRAPPER]


def test_importing_the_plugin_and_backend_imports_no_flashinfer() -> None:
    code = ("import sys, plugserve_attention_flashinfer.plugin, "
            "plugserve_attention_flashinfer.backend; "
            "assert 'flashinfer' not in sys.modules; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PLUGIN_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


def test_real_kernels_need_a_cuda_device() -> None:
    ctx = Shape(4).context(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="device 'cpu' is not CUDA"):
        FlashInferAttentionBackend(ctx)
