"""The shared-memory all-reduce: every rank ends with the parts summed in rank order, calls
in a row reuse the two phases safely, tensors larger than a slot go through in pieces, and a
rank that never arrives is named after the timeout. The ranks are threads here (the op runs
without the GIL); tests/parallel runs it between processes."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from plugserve.kernels import shm_all_reduce as shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no compiled kernels or /dev/shm")


def _ranks(world: int, slot_bytes: int, body: Callable[[shm.SharedMemoryAllReduce], object],
           timeout_s: float = 20.0) -> list[object]:
    path = shm.create_region_file(world, slot_bytes)
    try:
        ends = [shm.SharedMemoryAllReduce(path, r, world, timeout_s, slot_bytes)
                for r in range(world)]
    finally:
        os.unlink(path)  # the mappings stay valid: nothing is left in /dev/shm
    results: list[object] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(ends[rank])
        except BaseException as exc:  # reported by the main thread
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank is still waiting in the all-reduce"
    assert not os.path.exists(path)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum(dtype: torch.dtype, world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    calls = [[torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
             for n in (1, 7, 576, 3000, 64 * 576)]  # several calls: both phases, reused

    def body(end: shm.SharedMemoryAllReduce) -> list[torch.Tensor]:
        outs = []
        for parts in calls:
            mine = parts[end.rank].clone()
            assert end.all_reduce_(mine) is mine
            outs.append(mine)
        return outs

    results = _ranks(world, 64 << 10, body)
    for rank_out in results:
        assert isinstance(rank_out, list), rank_out
        for out, parts in zip(rank_out, calls, strict=True):
            assert torch.equal(out, shm.reference(parts))


def test_a_tensor_larger_than_a_slot_goes_in_pieces() -> None:
    parts = [torch.randn(1000, 3), torch.randn(1000, 3)]  # 12,000 bytes through 256-byte slots

    def body(end: shm.SharedMemoryAllReduce) -> tuple[torch.Tensor, int]:
        mine = parts[end.rank].clone()
        end.all_reduce_(mine)
        return mine, end.seq

    for result in _ranks(2, 256, body):
        assert isinstance(result, tuple), result
        out, seq = result
        assert torch.equal(out, shm.reference(parts))
        assert seq == 12_000 // 256 + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "slot_bytes"), [(1, 64 << 10), (5, 64 << 10), (64, 1024)])
def test_all_gather_joins_the_last_dim_in_rank_order(dtype: torch.dtype, rows: int,
                                                     slot_bytes: int) -> None:
    world, cols = 3, 100  # 64 rows of 400 bytes through 1,024-byte slots: 2 rows a call
    parts = [torch.randn(rows, cols).to(dtype) for _ in range(world)]

    def body(end: shm.SharedMemoryAllReduce) -> torch.Tensor:
        first = end.all_gather(parts[end.rank])
        second = end.all_gather(parts[end.rank] * 2)  # the other phase
        assert torch.equal(second, torch.cat(parts, dim=-1) * 2)
        return first

    for out in _ranks(world, slot_bytes, body):
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, torch.cat(parts, dim=-1))


def test_a_rank_that_never_arrives_is_named() -> None:
    path = shm.create_region_file(2, 1024)
    try:
        end = shm.SharedMemoryAllReduce(path, 0, 2, timeout_s=0.3, slot_bytes=1024)
    finally:
        os.unlink(path)
    with pytest.raises(shm.RankMissing, match=r"rank 1 did not reach.*within 0\.3 s"):
        end.all_reduce_(torch.ones(4))


def test_a_rank_whose_process_ended_is_named_before_the_timeout() -> None:
    import subprocess
    import sys
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = shm.create_region_file(2, 1024)
    try:
        end = shm.SharedMemoryAllReduce(path, 0, 2, timeout_s=60.0, slot_bytes=1024,
                                        pids=[os.getpid(), gone.pid])
    finally:
        os.unlink(path)
    t0 = time.monotonic()
    with pytest.raises(shm.RankMissing, match=f"rank 1 .*process {gone.pid} ended"):
        end.all_reduce_(torch.ones(4))
    assert time.monotonic() - t0 < 5.0
    assert not shm.process_ended(os.getpid())


def test_bad_arguments_are_refused() -> None:
    path = shm.create_region_file(2, 1024)
    try:
        with pytest.raises(ValueError, match="world size 9"):
            shm.SharedMemoryAllReduce(path, 0, 9, 1.0, 1024)
        end = shm.SharedMemoryAllReduce(path, 0, 2, 1.0, 1024)
    finally:
        os.unlink(path)
    assert not end.applies(torch.ones(4, dtype=torch.int64))
    assert not end.applies(torch.ones(4, 4).t())
