"""Freed large CPU activations stay mapped for the next step (glibc malloc settings)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Page faults of the second 25 MB allocation, after the first was written and freed.
_PROBE = """
import resource, torch
from plugserve.kernels.cpu_malloc import keep_freed_memory
applied = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = torch.empty(25 * 2**20 // 4).fill_(1.0)
del a
before = faults()
b = torch.empty(25 * 2**20 // 4).fill_(1.0)
print(applied, faults() - before)
"""


def _probe(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PLUGSERVE_CPU_KERNELS", "MALLOC_MMAP_THRESHOLD_",
                          "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again() -> None:
    pages = 25 * 2**20 // 4096
    applied, faults = _probe()
    assert applied
    assert faults < pages // 10
    # Without the settings every page faults again: the test can tell the difference.
    applied, faults = _probe(PLUGSERVE_CPU_KERNELS="0")
    assert not applied
    assert faults > pages // 2


def test_the_users_own_malloc_settings_win() -> None:
    applied, _ = _probe(MALLOC_MMAP_THRESHOLD_="131072")
    assert not applied
