"""Fixtures of the FA3 backend's tests.

CPU tests run the backend with `plugserve_attention_fa3.reference` in place of FA3 (the same
`flash_attn_with_kvcache` calls, interpreted in torch). `gpu`-marked tests run the real
kernels and are skipped without CUDA or without an FA3 build.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for path in (_HERE.parent, _HERE):  # run from a checkout without installing the plugin
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from plugserve.testing.gpu_backend import (  # noqa: E402
    cases,
    gpu_cases,
    skip_gpu_tests_unless,
)
from plugserve.testing.wheels import WheelUnavailable, cached_from_wheel, member  # noqa: E402
from plugserve_attention_fa3.environment import (  # noqa: E402
    PINNED_SGL_KERNEL,
    undefined_symbols,
)

__all__ = ["cases", "gpu_cases"]  # the shared fixtures, for the tests here


def _fa3_installed() -> bool:
    if importlib.util.find_spec("flash_attn_interface") is not None:
        return True
    try:
        return importlib.util.find_spec("sgl_kernel.flash_attn") is not None
    except ModuleNotFoundError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = torch.cuda.is_available() and _fa3_installed()
    skip_gpu_tests_unless(available, items, plugin_dir="attention_fa3",
                          reason="needs CUDA and an FA3 build (flash_attn_interface or "
                          "sgl_kernel.flash_attn; the [cuda] extra)")


# --- files of the pinned sgl-kernel wheel (API and ABI checks), fetched once and cached -------


def _flash_ops_symbols(wheel: zipfile.ZipFile) -> bytes:
    """The mangled symbols `sgl_kernel/flash_ops*.so` needs (the 850 MB library is not kept)."""
    name = next(n for n in wheel.namelist() if n.startswith("sgl_kernel/flash_ops"))
    with tempfile.TemporaryDirectory() as tmp:
        return "\n".join(sorted(undefined_symbols(Path(wheel.extract(name, tmp))))).encode()


def _sgl_kernel_file(name: str) -> Path:
    try:
        return cached_from_wheel("sgl-kernel", PINNED_SGL_KERNEL, {
            "flash_ops.undefined": _flash_ops_symbols,
            "flash_attn.py": member("sgl_kernel/flash_attn.py"),
        })[name]
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def sgl_kernel_file() -> Callable[[str], Path]:
    """`sgl_kernel_file(name)`: a cached file of the pinned sgl-kernel wheel (skips without)."""
    return _sgl_kernel_file
