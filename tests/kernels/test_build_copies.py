"""A start builds only the ISA copy of the CPU kernels it runs; `PLUGSERVE_CPU_ISAS=all` (the
test sessions) builds every copy this CPU runs, and the two libraries share every kernel
object: only the dispatch tables know which copies a library holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plugserve.kernels import build
from plugserve.kernels import compile as compile_mod
from plugserve.kernels import isa as isa_mod

LADDER = tuple(isa_mod.by_name(n) for n in ("scalar", "avx2", "avx512_vnni"))


@pytest.fixture
def cascade_lake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa_mod, "ladder", lambda: LADDER)
    monkeypatch.delenv(isa_mod.ENV_ISA, raising=False)


@pytest.mark.usefixtures("cascade_lake")
@pytest.mark.parametrize("copies,requested,names", [
    (None, None, ["avx512_vnni"]),
    ("one", None, ["avx512_vnni"]),
    (" One ", "avx2", ["avx2"]),
    ("all", None, ["scalar", "avx2", "avx512_vnni"]),
    ("all", "avx2", ["scalar", "avx2", "avx512_vnni"]),
])
def test_a_start_builds_the_copy_it_runs_unless_all_are_asked_for(
    monkeypatch: pytest.MonkeyPatch, copies: str | None, requested: str | None,
    names: list[str],
) -> None:
    if copies is None:
        monkeypatch.delenv(isa_mod.ENV_ISAS, raising=False)
    else:
        monkeypatch.setenv(isa_mod.ENV_ISAS, copies)
    if requested is not None:
        monkeypatch.setenv(isa_mod.ENV_ISA, requested)
    assert [isa.name for isa in isa_mod.to_build()] == names


@pytest.mark.usefixtures("cascade_lake")
def test_an_unknown_copies_value_is_refused_with_the_value_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(isa_mod.ENV_ISAS, "every")
    with pytest.raises(ValueError, match=r"PLUGSERVE_CPU_ISAS='every' is not one of: one, all"):
        isa_mod.to_build()


def test_only_the_dispatch_object_depends_on_the_copies_built() -> None:
    one = compile_mod.LibrarySpec(build.CSRC, LADDER[-1:], Path("/nonexistent"))
    every = compile_mod.LibrarySpec(build.CSRC, LADDER, Path("/nonexistent"))
    key_one, objects_one = compile_mod.library_key(one)
    key_every, objects_every = compile_mod.library_key(every)
    assert key_one != key_every
    shared = [job for job in objects_one if job.source.name != compile_mod.DISPATCH_SOURCE]
    assert len(shared) == len(objects_one) - 1
    assert all(objects_one[job] == objects_every[job] for job in shared)
    dispatch = next(j for j in objects_one if j.source.name == compile_mod.DISPATCH_SOURCE)
    assert objects_one[dispatch] != objects_every[dispatch]
    assert "-DPLUGSERVE_BUILT_scalar" in compile_mod.job_flags(every, dispatch)
    assert not any(f.startswith("-DPLUGSERVE_BUILT_")
                   for job in shared for f in compile_mod.job_flags(every, job))


_ONE_COPY = textwrap.dedent("""\
    import json
    from plugserve.kernels import build, status

    class Recording(status.Silent):
        compiled = []
        def job_done(self, label, seconds):
            self.compiled.append(label)

    rec = Recording()
    lib = build.prepare(rec)
    assert lib is not None, build.unavailable_reason()
    refused = None
    try:
        lib.set_isa("scalar")
    except ValueError as exc:
        refused = str(exc)
    print(json.dumps({"built": list(lib.built), "isas": lib.isas(), "isa": lib.isa(),
                      "compiled": rec.compiled, "refused": refused}))
""")


def test_a_one_copy_library_reuses_the_objects_and_refuses_other_copies() -> None:
    """In a process of its own (this one holds the library of every copy): the one-copy
    library compiles nothing but the dispatch tables, runs the best copy, and switching to
    another copy is refused with what to set."""
    library = build.library()
    if library is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    ladder = [isa.name for isa in isa_mod.ladder()]
    if len(ladder) < 2:
        pytest.skip("this CPU runs one copy only")
    env = {k: v for k, v in os.environ.items() if k != isa_mod.ENV_ISA}
    env[isa_mod.ENV_ISAS] = "one"
    out = subprocess.run([sys.executable, "-c", _ONE_COPY], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    best = ladder[-1]
    assert result["built"] == [best] and result["isas"] == [best] and result["isa"] == best
    assert result["compiled"] in ([], ["dispatch"])  # [] where an earlier run linked it
    assert result["refused"] is not None
    assert "PLUGSERVE_CPU_ISAS=all" in result["refused"] and best in result["refused"]


def test_the_module_entry_point_builds_or_says_why_not() -> None:
    """`python -m plugserve.kernels` (what setup runs in the background) finds the library
    of this session built and names its copies; with the kernels switched off it exits 1
    with the reason."""
    if build.library() is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    cmd = [sys.executable, "-m", "plugserve.kernels"]
    ready = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert ready.returncode == 0, ready.stderr[-3000:]
    copies = ", ".join(isa.name for isa in isa_mod.ladder())
    assert f"CPU kernels ready ({copies})" in ready.stderr
    off = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, build.ENV_SWITCH: "0"})
    assert off.returncode == 1
    assert "CPU kernels not built: PLUGSERVE_CPU_KERNELS=0" in off.stderr
