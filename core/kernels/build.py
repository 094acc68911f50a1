"""Compile and load the CPU kernels in `csrc/` with torch's C++ extension builder.

The kernels are compiled on first use, on the machine that runs them, for its own CPU
(`-march=native`: AVX2, AVX-512, AVX512-BF16 are whatever this CPU has), and cached by torch
under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). A machine without a C++
compiler, or a failed build, falls back to the pure-torch paths with one warning; so does
`PLUGSERVE_CPU_KERNELS=0`. The choice is made once per process, never on a hot path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ENV_SWITCH = "PLUGSERVE_CPU_KERNELS"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_reasons: dict[str, str] = {}


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


def load(name: str) -> ModuleType | None:
    """The compiled module for `csrc/<name>.cpp`, or None when it cannot be had here (the
    reason is in `unavailable_reason(name)`). Cheap after the first call (layers call it on
    every forward): a decided name is read without taking the lock."""
    if name in _loaded:  # decided once, never changed after
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        module = None
        if not enabled_by_environment():
            _reasons[name] = f"{ENV_SWITCH}=0"
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            _reasons[name] = "no C++ compiler (c++ or $CXX) on PATH"
        else:
            module = _build(name)
        _loaded[name] = module
        return module


def unavailable_reason(name: str) -> str | None:
    return _reasons.get(name)


_vectorised: dict[str, ModuleType | None] = {}


def load_vectorised(name: str) -> ModuleType | None:
    """`load(name)` for kernels that only have vector code (their `isa()` says which): None
    where it did not build or was built without AVX-512 (`isa() == "none"`). Asked once."""
    if name not in _vectorised:
        module = load(name)
        _vectorised[name] = module if module is not None and module.isa() != "none" else None
    return _vectorised[name]


def vectorised_unavailable_reason(name: str) -> str | None:
    """Why `load_vectorised(name)` is None (None when it is not)."""
    if load_vectorised(name) is not None:
        return None
    return unavailable_reason(name) or "this CPU has no AVX-512"


def _build(name: str) -> ModuleType | None:
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(
            name=f"plugserve_{name}", sources=[str(CSRC / f"{name}.cpp")],
            extra_cflags=[*_CFLAGS, f"-DPLUGSERVE_HEADERS={_headers_digest()}"], verbose=False,
        )
    except Exception as exc:  # a compiler error, a missing header: fall back, say why once
        _reasons[name] = f"build failed: {type(exc).__name__}: {str(exc).splitlines()[-1:]}"
        log.warning("plugserve: CPU kernel %r unavailable (%s); using the torch path",
                    name, _reasons[name])
        return None
    return module


def _headers_digest() -> str:
    """A digest of the shared headers in `csrc/`. torch rebuilds an extension when its
    sources or flags change, not its headers: this flag carries the headers' change."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]
