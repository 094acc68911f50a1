"""Runs of consecutive slots: stored and read as one block, the same values as per-row indexing."""

from __future__ import annotations

import pytest
import torch

from plugserve.pools.slot_runs import MIN_RUN, read_rows, run_start, store_rows


def test_run_start_finds_only_whole_increasing_runs() -> None:
    n = MIN_RUN + 5
    assert run_start(torch.arange(10, 10 + n)) == 10
    assert run_start(torch.arange(10, 10 + n, dtype=torch.int32)) == 10
    assert run_start(torch.arange(10, 10 + MIN_RUN - 1)) is None  # too short to be worth it
    gap = torch.arange(10, 10 + n)
    gap[8:] += 1  # one slot skipped
    assert run_start(gap) is None
    repeated = torch.arange(10, 10 + n)
    repeated[7] = repeated[8]  # first and last as a run would have them, a slot twice inside
    assert run_start(repeated) is None
    swapped = torch.arange(10, 10 + n)
    swapped[[3, 4]] = swapped[[4, 3]]  # first and last as a run would have them
    assert run_start(swapped) is None
    assert run_start(torch.arange(10, 10 + n).flip(0)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["run", "scattered", "short"])
def test_store_and_read_equal_per_row_indexing(dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n = MIN_RUN * 2 if kind != "short" else 5
    slots = torch.arange(40, 40 + n)
    if kind == "scattered":
        slots = torch.randperm(400, generator=gen)[:n] + 1
    rows = torch.randn(n, 3, 8, generator=gen).to(dtype)
    buffer = torch.randn(500, 3, 8, generator=gen).to(dtype)
    expected = buffer.clone().index_copy_(0, slots, rows)
    store_rows(buffer, slots, rows, run_start(slots))
    assert torch.equal(buffer, expected)
    read = read_rows(buffer, slots, run_start(slots))
    assert torch.equal(read, expected.index_select(0, slots))
    # a run is read as a view of the buffer (no copy), anything else as a copy
    assert (read.data_ptr() == buffer[int(slots[0])].data_ptr()) == (kind == "run")
