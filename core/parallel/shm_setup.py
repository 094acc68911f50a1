"""Start-up of the shared-memory all-reduce (`plugserve.kernels.shm_all_reduce`).

Every rank says whether it can take part (CPU model, the compiled op loaded, `/dev/shm`
there, `tp_shm_all_reduce` on) and which machine it is on (host name and boot id). Only when
all can and all share one machine does rank 0 create the region, every rank map it, and rank 0
remove its name after a barrier, so nothing is left in /dev/shm however the ranks end. Ranks
on several machines (torchrun across nodes) keep the backend's all-reduce.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plugserve.kernels import shm_all_reduce
from plugserve.kernels.shm_all_reduce import SharedMemoryAllReduce

log = logging.getLogger("plugserve.parallel")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    boot = BOOT_ID.read_text().strip() if BOOT_ID.is_file() else ""
    return f"{socket.gethostname()}/{boot}"


def why_not_here(enabled: bool, device_type: str, backend: str) -> str | None:
    """Why this rank cannot use the shared-memory all-reduce (None: it can)."""
    if not enabled:
        return "tp_shm_all_reduce is off"
    if device_type != "cpu" or backend != "gloo":
        return f"the model runs on {device_type} with {backend}"
    if not shm_all_reduce.available():
        return "the compiled CPU kernels or /dev/shm are unavailable"
    return None


def share_memory(rank: int, world_size: int, *, enabled: bool, device_type: str,
                 backend: str, timeout_s: float, group: Any) -> SharedMemoryAllReduce | None:
    """Every rank calls this at the same point of start-up; returns this rank's end of the
    region, or None (with the reason logged by rank 0) where the backend keeps the work."""
    mine = (why_not_here(enabled, device_type, backend), machine_id(), os.getpid())
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    reasons = [f"rank {r}: {why}" for r, (why, _, _) in enumerate(gathered) if why]
    if len({machine for _, machine, _ in gathered}) > 1:
        reasons.append("the ranks are on several machines")
    if reasons:
        if rank == 0:
            log.info("tensor parallel: all-reduce through %s (%s)", backend, "; ".join(reasons))
        return None
    path = [shm_all_reduce.create_region_file(world_size) if rank == 0 else None]
    try:
        dist.broadcast_object_list(path, src=0, group=group)
        shm = SharedMemoryAllReduce(str(path[0]), rank, world_size, timeout_s,
                                    pids=[pid for _, _, pid in gathered])
        dist.barrier(group=group)
    finally:
        if rank == 0 and path[0] is not None and os.path.exists(path[0]):
            os.unlink(path[0])  # every rank has it mapped (or start-up failed): drop the name
    if rank == 0:
        log.info("tensor parallel: all-reduce through shared memory (%d ranks on this machine)",
                 world_size)
    return shm
