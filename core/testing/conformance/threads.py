"""One intra-op CPU thread for a suite class: its models and data structures are tiny, so
threads cost more than they save, and on a shared machine they can slow a run down many
times over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


class OneCPUThread:
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _one_cpu_thread(cls) -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)
