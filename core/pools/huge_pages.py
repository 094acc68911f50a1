"""Memory on transparent huge pages (Linux): anonymous mappings advised MADV_HUGEPAGE
before their first touch, 2 MiB aligned, as torch tensors.

A stream over memory in 4 KiB pages crosses a page every 4 KiB: the hardware prefetcher
stops at each page boundary, and every page needs its own TLB entry, whose page walk a long
stream (a decode step reads every weight once) has pushed out of the caches. PyTorch's
allocator asks for huge pages only under `THP_MEM_ALLOC_ENABLE=1`, read once before the
first allocation, so the engine asks for them itself for the weights
(`plugserve.model.weight_pages`) and for the buffer that measures the read bandwidth
(`plugserve.bench.bandwidth`), so that figures measured against it compare like with like.
The KV pool stays on 4 KiB pages: carved from such an arena it made W (64 sequences, each
row's keys scattered over the pool) 7-10% slower, alternated runs on a 2-core Xeon, while
batch 1 (one row's keys in a run) gained ~3%, within the noise.

Nothing here where the kernel has no transparent huge pages (`enabled` is `never`), on
other systems than Linux, or with `PLUGSERVE_HUGE_PAGES=0`: callers then allocate as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
from pathlib import Path

import torch

ENV_SWITCH = "PLUGSERVE_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 * 1024 * 1024
ALIGN_BYTES = 64  # each piece's start: a cache line, and a multiple of every element size
MADV_HUGEPAGE = 14  # linux/mman.h
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


def thp_setting(path: Path = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or None
    where it has none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@functools.cache
def _c_library() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def available() -> bool:
    """Whether huge-page memory can be asked for here (see the module's docstring)."""
    return (enabled_by_environment() and _c_library() is not None
            and thp_setting() not in (None, "never"))


def _madvise(address: int, length: int, advice: int) -> bool:
    lib = _c_library()
    if lib is None:
        return False
    fn = lib.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return bool(fn(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0)


def malloc_trim() -> None:
    """Ask glibc to hand the process's free heap back to the kernel (no-op elsewhere)."""
    lib = _c_library()
    if lib is None or platform.libc_ver()[0] != "glibc":
        return
    fn = lib.malloc_trim
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    fn(0)


class Arena:
    """One anonymous mapping, 2 MiB aligned, advised MADV_HUGEPAGE before any page is
    touched (so it reads as zeros until written); `take(n)` hands out its bytes in order,
    each piece ALIGN_BYTES aligned. Use `new_arena`."""

    def __init__(self, nbytes: int) -> None:
        self.size = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE_BYTES,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the map alive
        skip = -whole.data_ptr() % HUGE_PAGE_BYTES
        self.bytes = whole[skip : skip + self.size]
        self.base_offset = skip  # of self.bytes in the map's storage
        self.advised = _madvise(self.bytes.data_ptr(), self.size, MADV_HUGEPAGE)
        self.used = 0

    def take(self, nbytes: int) -> int:
        """The storage offset (bytes, from the map's start) of the next nbytes."""
        start = self.used
        self.used = -(-(start + nbytes) // ALIGN_BYTES) * ALIGN_BYTES
        if self.used > self.size:
            raise RuntimeError(f"huge-page arena of {self.size} bytes overrun ({self.used})")
        return self.base_offset + start

    def storage(self) -> torch.UntypedStorage:
        return self.bytes.untyped_storage()


def new_arena(nbytes: int) -> Arena | None:
    """An arena of at least `nbytes` on huge pages, or None where there are none."""
    if not available():
        return None
    arena = Arena(nbytes)
    return arena if arena.advised else None


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of uint8 on huge pages, or None where there are none."""
    arena = new_arena(nbytes)
    return None if arena is None else arena.bytes[:nbytes]


def bytes_at(storage: torch.UntypedStorage, offset: int, shape: tuple[int, ...]
             ) -> torch.Tensor:
    """A contiguous uint8 tensor of `shape` at byte `offset` of `storage`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, shape, strides)


def huge_bytes_at(address: int, length: int, smaps: Path = Path("/proc/self/smaps")) -> int | None:
    """Bytes of [address, address + length) that the kernel backs with anonymous huge pages
    (the AnonHugePages of the mappings that hold the range, counted inside it as far as
    /proc/self/smaps tells), or None where it cannot say."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < address + length and hi > address
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, length)
