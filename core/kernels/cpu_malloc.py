"""Keep freed CPU memory in the process for the next step (glibc malloc settings).

A forward pass allocates and frees the same large activations every step (a 2,048-token
chunk's gate-up projection is 25 MB in float32). With glibc's defaults a block that large is
an `mmap` of fresh pages that `free` returns to the kernel, so every step pays a page fault
per 4 KiB page touched again: about a tenth of a float32 prefill here. Raising the mmap
threshold to glibc's maximum (32 MiB on 64-bit) and the trim threshold keeps those blocks in
the heap, where the next step reuses them already mapped (tcmalloc and jemalloc, which vLLM's
CPU build preloads, do the same by design).

Applied once, when an engine starts on the CPU, only under glibc, and never over settings the
user made through glibc's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` variables
or when `PLUGSERVE_CPU_KERNELS=0`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from plugserve.kernels.build import enabled_by_environment

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # keep up to 1 GiB of free heap top
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings (once per process); True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not enabled_by_environment() or any(v in os.environ for v in USER_VARIABLES):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.warning("plugserve: glibc refused the malloc settings; large CPU activations "
                    "will be mapped afresh every step")
    return ok
