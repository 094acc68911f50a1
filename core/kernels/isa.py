"""The instruction sets the CPU kernels are compiled for, and which one runs here.

Every kernel source in `csrc/kernels/` is compiled once per instruction set (ISA) into the
one extension (`plugserve.kernels.build`), each copy in its own C++ namespace, and the
extension picks one at run time from the CPU's features: the best one this CPU has, or
the one `PLUGSERVE_CPU_ISA` (or `use_isa`, in tests) asks for, which must be one this CPU
can run. On x86-64 the ladder is

    scalar        no vector flags (ATen's generic `Vectorized<T>`: plain loops the compiler
                  vectorises for SSE2)
    avx2          AVX2 + FMA + F16C (Haswell, Zen 1 and later)
    avx512        AVX-512 F/BW/DQ/VL (Skylake-SP, Zen 4 and later)
    avx512_vnni   AVX-512 + AVX512-VNNI (int8 dot products in one instruction: Cascade Lake,
                  Ice Lake-SP); only where avx512_bf16 does not run, which has VNNI too, and
                  instead of avx512 (the same code but the int8 dot product)
    avx512_bf16   AVX-512 + AVX512-BF16 (bf16 pair dot products) + AVX512-VNNI (int8 dot
                  products), which every CPU with AVX512-BF16 has (Cooper Lake, Zen 4)

and on 64-bit Arm `neon` (baseline) and `sve256` (SVE with 256-bit vectors, e.g. Graviton 3).
A copy may compile some of its sources with more flags (`OptIn`: the avx512_bf16 copy's AMX
kernels, `csrc/kernels/quant_amx.cpp`, `dense_amx.cpp` and `prefill_attention_amx.cpp`) where the compiler takes them;
the source then sees the opt-in's macro and checks the CPU at run time itself (elsewhere it
compiles a stub).
`ladder()` lists the ones this machine can run, lowest first. A start compiles only the copy
it runs (`to_build()`: the best, or `PLUGSERVE_CPU_ISA`'s), so a first start compiles one
copy of the kernels instead of every one; `PLUGSERVE_CPU_ISAS=all` (the test sessions, and
benchmarks that switch copies) builds every copy of the ladder into the library, reusing the
objects a one-copy build compiled. Each set of copies is its own library in the cache (its
own key); the kernel objects are shared between them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV_ISA = "PLUGSERVE_CPU_ISA"
ENV_ISAS = "PLUGSERVE_CPU_ISAS"
COPIES = ("one", "all")  # what PLUGSERVE_CPU_ISAS may say (default: one)


@dataclass(frozen=True)
class OptIn:
    """Extra flags for one kernel source of a copy, used where the compiler takes them (a
    probe compiles `probe` with them once per process): with them the source also sees
    `-D<macro>`."""

    source: str
    flags: tuple[str, ...]
    macro: str
    probe: str


# AMX tiles with bf16 dot products (Sapphire Rapids): GCC >= 11 / Clang >= 12 and binutils
# >= 2.36 know them. Three sources take them: the quantized and the dense bf16 AMX linears and
# the bf16 prefill attention.
_AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
_AMX_PROBE = (
    "#include <immintrin.h>\n"
    "void f(void* p) { _tile_loadd(1, p, 64); _tile_dpbf16ps(0, 1, 2); _tile_release(); }\n"
)
AMX_BF16 = OptIn("quant_amx.cpp", _AMX_FLAGS, "PLUGSERVE_AMX", _AMX_PROBE)
AMX_BF16_DENSE = OptIn("dense_amx.cpp", _AMX_FLAGS, "PLUGSERVE_AMX", _AMX_PROBE)
AMX_BF16_PREFILL = OptIn("prefill_attention_amx.cpp", _AMX_FLAGS, "PLUGSERVE_AMX", _AMX_PROBE)


@dataclass(frozen=True)
class Isa:
    """One instruction set: its name (also the C++ namespace of its copy of the kernels),
    the compiler flags and macros that select it, and the CPU features it needs."""

    name: str
    flags: tuple[str, ...]
    # ATen's macros: CPU_CAPABILITY names the namespace of its Vectorized<T> (one per copy,
    # so two copies never share an inline function) and CPU_CAPABILITY_<X> picks the
    # implementation.
    namespace: str
    implementations: tuple[str, ...]
    needs: frozenset[str] = frozenset()
    opt_ins: tuple[OptIn, ...] = ()

    @property
    def macros(self) -> tuple[str, ...]:
        return (
            f"-DCPU_CAPABILITY={self.namespace}", f"-DPLUGSERVE_ISA={self.name}",
            *(f"-DCPU_CAPABILITY_{x}" for x in self.implementations),
        )


_X86 = (
    Isa("scalar", (), "DEFAULT", ("DEFAULT",)),
    Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), "AVX2", ("AVX2",),
        frozenset({"avx2", "fma", "f16c"})),
    Isa(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
        "AVX512", ("AVX512",),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}),
    ),
    Isa(
        "avx512_vnni",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
         "-mavx512vnni"),
        "AVX512_VNNI", ("AVX512",),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c",
                   "avx512_vnni"}),
    ),
    Isa(
        "avx512_bf16",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
         "-mavx512bf16", "-mavx512vnni"),
        # Its own namespace for ATen's vector types: the copy built with bf16 instructions
        # must not share inline functions with the plain AVX-512 one.
        "AVX512_BF16", ("AVX512",),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16",
                   "avx512_vnni"}),
        (AMX_BF16, AMX_BF16_DENSE, AMX_BF16_PREFILL),
    ),
)
_ARM = (
    Isa("neon", (), "DEFAULT", ("DEFAULT",)),
    Isa("sve256", ("-march=armv8.2-a+sve", "-msve-vector-bits=256"), "SVE256",
        ("SVE", "SVE256"), frozenset({"sve256"})),
)
ALL = _X86 + _ARM
NAMES = tuple(isa.name for isa in ALL)


def _cpu_flags() -> frozenset[str]:
    """The feature flags the kernel reports for this CPU (Linux: /proc/cpuinfo), plus
    `sve256` where torch found 256-bit SVE."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(value.split())
                break
    else:  # elsewhere, what torch's own dispatch found (AVX2 / AVX512 only)
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        if capability in ("AVX2", "AVX512"):
            flags.update({"avx2", "fma", "f16c"})
        if capability == "AVX512":
            flags.update({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    if "sve" in flags:
        import torch

        if torch.backends.cpu.get_cpu_capability() == "SVE256":
            flags.add("sve256")
    return frozenset(flags)


def has_cpu_flag(flag: str) -> bool:
    """Whether this CPU reports feature `flag` (a /proc/cpuinfo name, e.g. "amx_bf16")."""
    return flag in _cached_flags()


@functools.cache
def _cached_flags() -> frozenset[str]:
    return _cpu_flags()


@functools.cache
def ladder() -> tuple[Isa, ...]:
    """The ISAs this machine can run, lowest first (always at least the baseline)."""
    machine = platform.machine().lower()
    candidates: tuple[Isa, ...]
    if machine in ("x86_64", "amd64"):
        candidates = _X86
    elif machine in ("aarch64", "arm64"):
        candidates = _ARM
    else:
        return (_X86[0],)
    flags = _cpu_flags()
    runs = tuple(isa for isa in candidates if isa.needs <= flags)
    names = {isa.name for isa in runs}
    # One copy less each to build and test under `PLUGSERVE_CPU_ISAS=all`: avx512_bf16 has
    # VNNI too; and avx512_vnni is avx512 with the int8 dot product, so the plain copy is left
    # to CPUs without VNNI, except beside avx512_bf16, where it runs bf16 without native bf16.
    skip = {"avx512_vnni"} if "avx512_bf16" in names else set()
    if "avx512_vnni" in names and "avx512_bf16" not in names:
        skip.add("avx512")
    return tuple(isa for isa in runs if isa.name not in skip)


def by_name(name: str) -> Isa:
    for isa in ALL:
        if isa.name == name:
            return isa
    raise ValueError(f"unknown CPU instruction set {name!r}; known: {', '.join(NAMES)}")


def requested() -> str | None:
    """The ISA `PLUGSERVE_CPU_ISA` asks for (None: the best this CPU has)."""
    value = os.environ.get(ENV_ISA, "").strip().lower()
    return value or None


def copies() -> str:
    """What `PLUGSERVE_CPU_ISAS` asks for: "one" (the default) or "all"; anything else is a
    ValueError naming the value and what is allowed."""
    value = os.environ.get(ENV_ISAS, "").strip().lower() or "one"
    if value not in COPIES:
        raise ValueError(f"{ENV_ISAS}={value!r} is not one of: {', '.join(COPIES)} (one: the "
                         "copy that runs; all: every copy this CPU runs, to switch between them)")
    return value


def to_build() -> tuple[Isa, ...]:
    """The copies to compile into the library, lowest first: every copy of `ladder()` under
    `PLUGSERVE_CPU_ISAS=all`, else only the one that runs (`PLUGSERVE_CPU_ISA`'s, which must
    be runnable here, or the best)."""
    runnable = ladder()
    if copies() == "all":
        return runnable
    name = requested()
    return (check_runnable(name),) if name is not None else (runnable[-1],)


def check_runnable(name: str) -> Isa:
    """The ISA called `name`, if this CPU runs it; otherwise a ValueError that says which
    ones it runs."""
    isa = by_name(name)
    runnable = ladder()
    if isa not in runnable:
        raise ValueError(
            f"this CPU cannot run the {name} kernels; it runs: "
            f"{', '.join(i.name for i in runnable)}"
        )
    return isa


def has_bf16_dot(name: str) -> bool:
    """Whether the kernels of ISA `name` multiply bf16 pairs natively (vdpbf16ps)."""
    return name == "avx512_bf16"


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels of ISA `name` inside the block (tests force a lower ISA on a CPU that
    has a higher one); the previous choice is restored after."""
    from plugserve.kernels import build

    library = build.library()
    if library is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    before = library.isa()
    library.set_isa(name)
    try:
        yield
    finally:
        library.set_isa(before)
