"""Software prefetches survive the compiler: GCC counts `__builtin_prefetch` as no effect, so
a helper whose only work is prefetching is taken for a pure function and every call to it
that was not inlined first is deleted (the avx2 copy's bf16 batch-1 walk once ran without a
single prefetch that way). pvec.h's prefetch functions carry an effect GCC must keep, and
every prefetch in the kernels goes through them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from plugserve.kernels import build
from plugserve.kernels import compile as compile_mod
from plugserve.kernels import isa as isa_mod

# A caller that walks a buffer asking for each line 4 KiB ahead through a helper of its file,
# kept out of line (what GCC's function splitting did to the bf16 walk's helper).
SNIPPET = """
#include "vec/pvec.h"
PLUGSERVE_ISA_BEGIN
namespace {
__attribute__((noinline)) void ask_ahead(const char* p) { vec::prefetch_l2(p + 4096); }
}  // namespace
PLUGSERVE_ISA_END
extern "C" void walk_prefetching(const char* p, long n) {
  for (long i = 0; i < n; i += 64) plugserve::PLUGSERVE_ISA::ask_ahead(p + i);
}
"""


def _body(assembly: str, symbol: str) -> str:
    """The instructions of `symbol` in GCC's assembly output (its label line left out)."""
    start = assembly.index(f"\n{symbol}:") + len(symbol) + 2
    end = assembly.index(".cfi_endproc", start)
    return assembly[start:end]


@pytest.mark.skipif(shutil.which(compile_mod.compiler()) is None, reason="no C++ compiler")
def test_a_call_to_a_prefetching_helper_is_kept(tmp_path: Path) -> None:
    isa = isa_mod.ladder()[-1]
    source = tmp_path / "walk.cpp"
    source.write_text(SNIPPET)
    out = tmp_path / "walk.s"
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    subprocess.run(
        [compile_mod.compiler(), "-O3", "-std=c++20", "-fPIC", "-Wno-psabi",
         f"-I{build.CSRC}", *includes, *isa.flags, *isa.macros, "-S", str(source),
         "-o", str(out)],
        check=True, capture_output=True, text=True,
    )
    walk = _body(out.read_text(), "walk_prefetching")
    assert re.search(r"\b(call|bl|jmp|b)\b.*ask_ahead|prefetch|prfm", walk), (
        f"the calls to the prefetching helper were deleted ({isa.name} copy):\n{walk}"
    )


def test_every_prefetch_goes_through_pvec() -> None:
    csrc = Path(build.CSRC)
    direct = [
        f"{path.relative_to(csrc)}:{number}"
        for path in sorted(csrc.rglob("*"))
        if path.suffix in (".h", ".cpp") and path.name != "pvec.h"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"__builtin_prefetch|_mm_prefetch", line.split("//")[0])
    ]
    assert not direct, f"prefetches outside vec/pvec.h's functions: {direct}"
