"""Flags kernel sources of one ISA copy opt into (`isa.OptIn`: the AMX kernels of the
avx512_bf16 copy) reach those sources only, and only where a probe compile shows the compiler
takes them; a toolchain without them builds every copy without (the source's stub). Which
copies a CPU's features build (the ladder)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plugserve.kernels import build
from plugserve.kernels import compile as compile_mod
from plugserve.kernels import isa as isa_mod

BF16 = isa_mod.by_name("avx512_bf16")
AMX_SOURCES = ("quant_amx.cpp", "dense_amx.cpp", "prefill_attention_amx.cpp")


def _spec(isas: tuple[isa_mod.Isa, ...]) -> compile_mod.LibrarySpec:
    return compile_mod.LibrarySpec(build.CSRC, isas, Path("/nonexistent"))


def _flags(spec: compile_mod.LibrarySpec, source: str, isa: isa_mod.Isa) -> list[str]:
    job = next(j for j in spec.jobs() if j.source.name == source and j.isa == isa)
    return compile_mod.job_flags(spec, job)


@pytest.mark.parametrize("accepted", [True, False])
def test_the_amx_flags_reach_the_amx_sources_of_one_copy(monkeypatch: pytest.MonkeyPatch,
                                                          accepted: bool) -> None:
    monkeypatch.setattr(compile_mod, "compiler_accepts", lambda flags, probe, cache_dir=None: accepted)
    isas = (isa_mod.by_name("avx512"), BF16)
    spec = _spec(isas)
    for source in AMX_SOURCES:
        amx = _flags(spec, source, BF16)
        assert ("-mamx-tile" in amx and "-DPLUGSERVE_AMX" in amx) == accepted
    for job in spec.jobs():
        if job.isa is not None and (job.source.name not in AMX_SOURCES or job.isa != BF16):
            flags = compile_mod.job_flags(spec, job)
            assert "-mamx-tile" not in flags and "-DPLUGSERVE_AMX" not in flags


@pytest.mark.skipif(shutil.which(compile_mod.compiler()) is None, reason="no C++ compiler")
def test_the_probe_refuses_flags_the_compiler_does_not_take() -> None:
    assert compile_mod.compiler_accepts((), "int f() { return 1; }\n")
    assert not compile_mod.compiler_accepts(("-mno-such-instruction-set",),
                                            "int f() { return 1; }\n")


@pytest.mark.skipif(shutil.which(compile_mod.compiler()) is None, reason="no C++ compiler")
def test_the_probe_answer_is_kept_for_later_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = "int g() { return 2; }\n"
    flags = ("-O1",)
    assert compile_mod.compiler_accepts(flags, probe, tmp_path)
    assert [f.read_text() for f in tmp_path.glob("*.accepts")] == ["yes\n"]
    # A later start: nothing in this process's memory, and no compiler to run (the
    # compiler's identity is asked once per process, already done).
    monkeypatch.setattr(compile_mod, "_accepts", {})

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("the probe was compiled again")

    monkeypatch.setattr(compile_mod.subprocess, "run", no_compile)
    assert compile_mod.compiler_accepts(flags, probe, tmp_path)
    # Another answer in the file is what a later start believes.
    next(tmp_path.glob("*.accepts")).write_text("no\n")
    monkeypatch.setattr(compile_mod, "_accepts", {})
    assert not compile_mod.compiler_accepts(flags, probe, tmp_path)


_AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags,names", [
    (_AVX512, ["scalar", "avx2", "avx512"]),  # Skylake-SP
    # Cascade Lake: the vnni copy instead of the plain one (the same code but the dot product)
    (_AVX512 | {"avx512_vnni"}, ["scalar", "avx2", "avx512_vnni"]),
    # AVX512-BF16 comes with VNNI: its copy has both, the vnni one is not built; the plain
    # one is, for bf16 without native bf16
    (_AVX512 | {"avx512_vnni", "avx512_bf16"}, ["scalar", "avx2", "avx512", "avx512_bf16"]),
    ({"avx2", "fma", "f16c"}, ["scalar", "avx2"]),
])
def test_the_ladder_builds_one_copy_per_avx512_kind(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], names: list[str]
) -> None:
    monkeypatch.setattr(isa_mod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa_mod, "_cpu_flags", lambda: frozenset(flags))
    assert [isa.name for isa in isa_mod.ladder.__wrapped__()] == names
    vnni = isa_mod.by_name("avx512_vnni")
    assert "-mavx512vnni" in vnni.flags and "-DCPU_CAPABILITY=AVX512_VNNI" in vnni.macros
