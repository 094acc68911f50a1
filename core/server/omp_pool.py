"""Release the OpenMP thread pool of the thread that built the engine, before another thread
runs its steps.

GNU OpenMP (libgomp, what torch's CPU wheels ship) keeps one worker pool per thread that ran a
parallel region. The server builds the engine on one thread (model load, kernel warm-up) and
runs its steps on another (the engine thread), so the process holds two pools. libgomp then
counts more OpenMP threads than CPUs (3 for 2 with torch's 2 intra-op threads) and, from then
on, throttles every barrier's spin-wait to 100 iterations: the workers sleep on a futex
between the step's many parallel regions and each region waits for a wake-up. Measured on a
2-core KVM guest (SmolLM2-135M, fp32, 64 x 128 / 128 tokens, `Engine.generate`): a decode step
of 64 rows takes 140 ms when the steps run on a second thread and 120-124 ms on the building
thread, or on a second thread once the first one's pool is released; served, 145-149 ms before
this release.

`release_openmp_pool()` frees the calling thread's pool (`omp_pause_resource_all`, OpenMP 5.0;
libgomp frees only the caller's pool) so that the engine thread's pool is the only one. The
calling thread may still run parallel regions later (its pool comes back); the server's HTTP
side does not. Other OpenMP runtimes are left alone: LLVM's and Intel's pause the whole
runtime, which is unsafe while another thread computes.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger("plugserve.server")

OMP_PAUSE_SOFT = 1


def loaded_libgomp() -> Path | None:
    """The GNU OpenMP library mapped into this process (torch's `libgomp.so.1`, or a wheel's
    renamed `libgomp-<hash>.so.1`), or None (no OpenMP yet, another runtime, not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libgomp"):
                    return Path(parts[-1])
    except OSError:
        pass
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's libgomp worker pool; True when libgomp took the request.
    Call it where no parallel region runs on this thread (any Python code outside torch)."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(str(path)).omp_pause_resource_all
    except (OSError, AttributeError):  # an old libgomp without OpenMP 5.0's pause
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    released = int(pause(OMP_PAUSE_SOFT)) == 0
    if not released:
        log.debug("libgomp (%s) did not release this thread's OpenMP pool", path)
    return released
