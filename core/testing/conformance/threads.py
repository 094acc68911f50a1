"""One intra-op CPU thread for a suite class: its models and data structures are tiny, so
threads cost more than they save, and on a shared machine they can slow a run down many
times over. `cpu_threads(n)` sets the count for a block (kernel tests across thread counts)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class OneCPUThread:
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _one_cpu_thread(cls) -> Iterator[None]:
        with cpu_threads(1):
            yield
