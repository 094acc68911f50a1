"""Test-session settings shared by `tests/` and every plugin's `tests/`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Without CUDA, Triton runs only in its CPU interpreter, which it reads when a kernel is
# decorated: switch it on before any test imports triton (torch.compile, an optimizer or a
# backend may), whichever test directories a session collects.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The kernel tests run every ISA copy of the CPU kernels this machine has (a start outside the
# tests builds only the copy it runs): every process of a test session, engines and servers
# started by the tests included, loads the library of all copies (one build for the session).
os.environ["PLUGSERVE_CPU_ISAS"] = "all"


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread() -> Iterator[None]:
    """The tests run tiny models: intra-op threads cost more than they save, and on a
    shared 2-core machine they can slow a tiny forward down a hundredfold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
