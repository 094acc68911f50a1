"""Whether this machine can run FlashInfer's kernels, checked without importing flashinfer.

FlashInfer 0.7 ships its attention kernels as CUDA sources that it JIT-compiles with `nvcc`
at a wrapper's first `plan()`, unless the `flashinfer-jit-cache` package (pre-built kernels
for a CUDA version) is installed. That package is not on PyPI: `flashinfer
install-jit-cache-wheel` (a command of flashinfer-python) installs the one matching the
installed flashinfer and CUDA. Without either, the first batch fails deep inside FlashInfer
with "Could not find nvcc"; this module finds out at start-up instead, the way FlashInfer
looks for nvcc (`flashinfer/jit/cpp_ext.py` `get_cuda_path`: `CUDA_HOME`/`CUDA_PATH`, else
`nvcc` on PATH, else /usr/local/cuda).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from importlib import metadata

import torch

# The flashinfer-python these checks ran against (reference.py, tests/test_flashinfer_api.py).
PINNED_FLASHINFER = "0.7.2.post1"
INSTALL_HINT = "pip install 'plugserve-attention-flashinfer[cuda]'"
KERNELS_HINT = (
    "run `flashinfer install-jit-cache-wheel` (pre-built kernels matching this flashinfer and "
    "CUDA), or install the CUDA toolkit and put nvcc on PATH (or set CUDA_HOME)"
)


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def nvcc_path() -> str | None:
    """nvcc where FlashInfer's JIT would look for it, or None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidate = os.path.join(cuda_home, "bin", "nvcc")
        return candidate if os.path.exists(candidate) else None
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.exists(default) else None


def kernels_problem() -> str | None:
    """Why FlashInfer could not get its kernels here (None: pre-built or compilable)."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None or nvcc_path():
        return None
    return ("flashinfer has no pre-built kernels here (flashinfer-jit-cache is not installed) "
            f"and cannot compile them (no nvcc): {KERNELS_HINT}")


def unavailable_reason() -> str | None:
    """Every reason this machine cannot run the backend, in one line (None: it can)."""
    reasons = []
    version = installed_version("flashinfer-python")
    if version is None:
        reasons.append(f"flashinfer-python is not installed ({INSTALL_HINT})")
    if not torch.cuda.is_available():
        reasons.append(f"torch {torch.__version__} sees no CUDA device")
    if version is not None:
        problem = kernels_problem()
        if problem:
            reasons.append(problem)
    return "; ".join(reasons) or None
