"""The kernel tests run on every ISA copy of the CPU kernels this machine can run.

A module opts in with `pytestmark = pytest.mark.usefixtures("kernel_isa")`: each of its tests
then runs once per copy (scalar, avx2, and avx512_vnni or avx512 and avx512_bf16 on a CPU
with them), so an AVX-512 machine also tests the AVX2 and scalar code against the references. The fixture
checks that the library really switched to that copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from plugserve.kernels import build
from plugserve.kernels import isa as isa_mod

ISAS = [isa.name for isa in isa_mod.ladder()]


@pytest.fixture(params=ISAS)
def kernel_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    library = build.library()
    if library is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    name = str(request.param)
    with isa_mod.use_isa(name):
        assert library.ops.isa() == name and library.isa() == name
        yield name
