"""Tensor-parallel all-reduce through shared memory (`csrc/ops/shm_all_reduce.cpp`).

`SharedMemoryAllReduce` maps one region that every rank of one machine shares and sums a
float tensor over the ranks through it: each rank copies its part into its slot, publishes a
call counter, waits for the others' counters and adds the slots in rank order (identical bits
on every rank). A call costs a few microseconds where gloo's TCP loopback costs about a
millisecond; vLLM's and SGLang's CPU backends do the same for the same reason. Tensors larger
than a slot go through in slot-sized pieces. While a rank is late the waiting rank looks every
`POLL_S` whether that rank's process still lives (a killed rank is named within a fraction of
a second, as a broken gloo connection would be) and gives up after `timeout_s`.

The region is a file in `/dev/shm`: rank 0 creates it, every rank maps it, and rank 0 removes
the name once all have mapped it (`unlink`), so no file outlives the ranks, even after
kill -9. `reference` is the sum the op computes, for tests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from plugserve.kernels import build

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 << 20  # per rank and phase: a 2,048-token prefill's hidden states of 512 floats
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


POLL_S = 0.25  # while a rank is late, look this often whether its process still lives


class RankMissing(RuntimeError):
    """A rank did not reach the all-reduce: its process ended, or it hung past the timeout."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} did not reach the shared-memory all-reduce: {why}")
        self.rank = rank


def process_ended(pid: int) -> bool:
    """Whether process `pid` of this machine is gone or a zombie (it died)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] in ("Z", "X")


def available() -> bool:
    """True when the compiled op loads here and /dev/shm exists."""
    return SHM_DIR.is_dir() and build.library() is not None


def region_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    return int(build.ops().shm_header_bytes()) + 2 * world * slot_bytes


def create_region_file(world: int, slot_bytes: int = SLOT_BYTES) -> str:
    """Rank 0: a new zero-filled region file in /dev/shm; returns its path."""
    fd = os.open(SHM_DIR, os.O_RDONLY)  # fail early with a clear error if it is missing
    os.close(fd)
    import tempfile

    fd, path = tempfile.mkstemp(prefix="plugserve-tp-", dir=SHM_DIR)
    try:
        os.ftruncate(fd, region_bytes(world, slot_bytes))
    finally:
        os.close(fd)
    return path


class SharedMemoryAllReduce:
    """One rank's end of the region at `path` (see the module docstring)."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float,
                 slot_bytes: int = SLOT_BYTES, pids: Sequence[int] | None = None) -> None:
        max_ranks = int(build.ops().shm_max_ranks())
        if not 1 <= world <= max_ranks:
            raise ValueError(f"shared-memory all-reduce: world size {world} (1 to {max_ranks})")
        self.rank, self.world = rank, world
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self.region = torch.from_file(path, shared=True, size=region_bytes(world, slot_bytes),
                                      dtype=torch.uint8)
        self.seq = 0  # calls made; the same count on every rank
        self.pids = list(pids) if pids is not None else None  # every rank's process id

    def applies(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu and tensor.dtype in _DTYPES and tensor.is_contiguous()

    def gathers(self, local: torch.Tensor) -> bool:
        return local.is_cpu and local.dtype in _DTYPES and local.ndim == 2

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (every rank calls with the same shape)."""
        flat = tensor.view(-1)
        per_call = self.slot_bytes // tensor.element_size()
        op = build.ops().shm_all_reduce_
        for start in range(0, max(flat.numel(), 1), per_call):
            self._call(op, flat[start : start + per_call])
        return tensor

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local` [rows, cols] joined along the last dim in rank order:
        [rows, world * cols] (every rank calls with the same shape)."""
        local = local.contiguous()
        rows, cols = local.shape
        out = local.new_empty(rows, self.world * cols)
        rows_per_call = max(1, self.slot_bytes // max(1, cols * local.element_size()))
        op = build.ops().shm_all_gather
        for start in range(0, max(rows, 1), rows_per_call):
            stop = start + rows_per_call
            self._call(op, out[start:stop], local[start:stop])
        return out

    def _call(self, op: Any, *tensors: torch.Tensor) -> None:
        """One call number: publish, then wait (looking at a late rank's process)."""
        self.seq += 1
        waited_s, resume = 0.0, False
        while True:
            wait_s = min(POLL_S, self.timeout_s - waited_s)
            missing = int(op(*tensors, self.region, self.rank, self.world, self.seq,
                             self.slot_bytes, wait_s, resume))
            if missing < 0:
                return
            waited_s, resume = waited_s + wait_s, True
            if self.pids is not None and process_ended(self.pids[missing]):
                raise RankMissing(missing, f"its process {self.pids[missing]} ended")
            if waited_s >= self.timeout_s:
                raise RankMissing(missing, f"it did not arrive within {self.timeout_s:g} s "
                                           "(it hangs)")


def reference(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank holds afterwards: the parts summed in rank order in float32, rounded
    once to their dtype."""
    total = parts[0].float().clone()
    for part in parts[1:]:
        total += part.float()
    return total.to(parts[0].dtype)
