"""Freed large CPU activations stay in the process for the next step (glibc malloc settings).

Checked through glibc's own accounting (`mallinfo2`): with the settings a 25 MB block comes
from the heap and the heap keeps it after `free`; without them the block is a separate
mapping that `free` returns to the kernel. (Counting page faults on reuse instead depends on
the kernel: a host that reclaims cold pages, as DAMON does, faults them in again anyway.)
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
    or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="glibc >= 2.33 (mallinfo2) only",
)

# mapped = bytes in separate mmap blocks; heap = bytes of the heap (arena), both in MiB,
# while a 25 MB tensor is alive and after it is freed.
_PROBE = """
import ctypes, torch
from plugserve.kernels.cpu_malloc import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = keep_freed_memory()
before = libc.mallinfo2()
block = torch.empty(25 * 2**20 // 4).fill_(1.0)
alive = libc.mallinfo2()
del block
freed = libc.mallinfo2()
mib = lambda n: n >> 20
print(applied, mib(alive.hblkhd - before.hblkhd), mib(alive.arena - before.arena),
      mib(freed.arena - before.arena))
"""


def _probe(**env: str) -> tuple[bool, int, int, int]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PLUGSERVE_CPU_KERNELS", "MALLOC_MMAP_THRESHOLD_",
                          "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2]), int(out[3])


def test_a_freed_block_stays_in_the_heap_for_reuse() -> None:
    applied, mapped, heap_alive, heap_freed = _probe()
    assert applied
    assert mapped == 0  # not a separate mapping
    assert heap_alive >= 25  # from the heap
    assert heap_freed >= 25  # and the heap keeps it after free
    # Without the settings it is its own mapping, returned on free: the test can tell.
    applied, mapped, heap_alive, heap_freed = _probe(PLUGSERVE_CPU_KERNELS="0")
    assert not applied
    assert mapped >= 25
    assert heap_freed < 25


def test_the_users_own_malloc_settings_win() -> None:
    applied, *_ = _probe(MALLOC_MMAP_THRESHOLD_="131072")
    assert not applied
