"""Test-session settings shared by `tests/` and every plugin's `tests/`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread() -> Iterator[None]:
    """The tests run tiny models: intra-op threads cost more than they save, and on a
    shared 2-core machine they can slow a tiny forward down a hundredfold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
