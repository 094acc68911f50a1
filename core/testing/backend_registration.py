"""Shared tests of an attention-backend plugin's registration (fa3, flashinfer, yours).

A plugin subclasses `BackendRegistrationCases` in its own test module and names what it
registers; pytest collects the subclass there:

    class TestFA3Registration(BackendRegistrationCases):
        attention = "fa3"
        distribution = "plugserve-attention-fa3"
        plugin_module = plugin
        capabilities_module = capabilities
        backend_cls = FA3AttentionBackend
        availability = staticmethod(unavailable_reason)
        fix_toggles = (DRAFT_PAGE_SCATTER,)
        kernel_modules = frozenset({"flash_attn_interface", "sgl_kernel", "flash_attn"})
        plugin_root = Path(__file__).resolve().parents[1]
        expected_capabilities = {"dtypes": frozenset({"bfloat16", "float16"})}

The cases: the hook registers the backend once with its capabilities (CUDA only, custom
masks, topk>1, windows, the page>1+topk>1 whitelist by distribution, and
`expected_capabilities`), the not-verified note, the fix toggles in order, importing the
plugin and backend modules loads none of `kernel_modules`, and the real kernels refuse a
non-CUDA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from plugserve.attention.base import AttentionBackend
from plugserve.attention.capabilities import gpu_verification_note
from plugserve.attention.whitelist import whitelisted_for_page_tree
from plugserve.testing.paged_cases import Shape

__all__ = ["BackendRegistrationCases"]


class BackendRegistrationCases:
    attention: ClassVar[str]
    distribution: ClassVar[str]
    plugin_module: ClassVar[ModuleType]
    capabilities_module: ClassVar[ModuleType]
    backend_cls: ClassVar[type[AttentionBackend]]
    availability: ClassVar[Callable[..., Any]]
    fix_toggles: ClassVar[tuple[str, ...]]
    kernel_modules: ClassVar[frozenset[str]]
    plugin_root: ClassVar[Path]
    expected_capabilities: ClassVar[dict[str, object]] = {}

    def test_hook_registers_the_backend_with_its_capabilities(self) -> None:
        calls = []
        self.plugin_module.plugserve_register_attention_backends(
            lambda name, loader, caps, description="", availability=None: calls.append(
                (name, caps, description, availability)))
        assert len(calls) == 1
        name, caps, description, availability = calls[0]
        assert availability is self.availability
        assert name == self.attention and description
        assert caps is self.capabilities_module.CAPABILITIES
        assert caps.devices == frozenset({"cuda"})
        assert caps.custom_mask and caps.topk_gt1 and caps.sliding_window
        for field, want in self.expected_capabilities.items():
            assert getattr(caps, field) == want, field
        assert whitelisted_for_page_tree(self.distribution, self.attention)

    def test_not_verified_until_a_gpu_run_says_so(self) -> None:
        assert self.capabilities_module.VERIFIED_ON is None
        assert self.capabilities_module.CAPABILITIES.notes[0] == (
            "not verified on a GPU yet: run "
            f"`plugserve conformance --attention {self.attention} --device cuda`")
        assert gpu_verification_note(self.attention, "H200, 2026-11-23, conformance") == (
            "verified on a GPU: H200, 2026-11-23, conformance")

    def test_hook_registers_the_fix_toggles(self) -> None:
        names: list[str] = []
        self.plugin_module.plugserve_register_fix_toggles(
            lambda name, description: names.append(name))
        assert names == list(self.fix_toggles)

    def test_importing_the_plugin_and_backend_imports_no_kernel_library(self) -> None:
        code = (f"import sys, {self.plugin_module.__name__}, {self.backend_cls.__module__}; "
                f"assert not {set(self.kernel_modules)!r} & set(sys.modules); print('ok')")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(self.plugin_root),
             *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "ok"

    def test_real_kernels_need_a_cuda_device(self) -> None:
        ctx = Shape(4).context(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="device 'cpu' is not CUDA"):
            self.backend_cls(ctx)
