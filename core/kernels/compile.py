"""Compile the CPU kernels into one shared library, safely and visibly.

`build_library(spec, status)` returns the path of the library for `spec` (its sources, ISAs
and flags), compiling it first if this cache has none:

- one compiler job per source and ISA (`csrc/kernels/*.cpp` once per ISA, `csrc/*.cpp` and
  `csrc/ops/*.cpp` once), `MAX_JOBS` at a time (default: the CPU count), longest first; each
  object is cached under a digest of its source, every header and its flags, so an edit
  recompiles only what it touches;
- the library is linked in a private `.build-*` folder and moved into place with one rename:
  a build killed at any point (kill -9 included) leaves no half-written library, and the next
  start removes its folder;
- builders take an advisory file lock (`filelock`, an `flock` the kernel drops when its owner
  dies), so two processes never build at once and a dead builder never blocks the next one.

Progress goes to `status` (`plugserve.kernels.status`): what is compiled, for which ISA, why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugserve.kernels.isa import Isa
    from plugserve.kernels.status import BuildStatus

LIBRARY = "plugserve_cpu"
DISPATCH_SOURCE = "dispatch.cpp"  # the one source that sees which copies are built
# Sources compiled with more flags in every copy. elementwise.cpp: -fno-trapping-math, so that
# GCC turns the range clamps and NaN selects of its plain loops into vector selects on AVX2
# too: without AVX-512's mask registers it kept them as branches, so SiLU * up (float32 and
# bf16) and the bf16 add + RMSNorm stayed scalar in the avx2 copy, 5-7x the AVX-512 copy's
# time. The flag changes no value, only whether an operation may raise a floating-point
# exception flag (tests/kernels/test_fused_elementwise.py: every copy's results).
SOURCE_FLAGS: dict[str, tuple[str, ...]] = {"elementwise.cpp": ("-fno-trapping-math",)}
# Waiting on another process's build: bounded, but long enough for a slow first build.
LOCK_WAIT_S = 1800.0


class BuildError(RuntimeError):
    """The kernels did not compile or link; the message ends with the compiler's output."""


@dataclass(frozen=True)
class Job:
    source: Path
    isa: Isa | None  # None: compiled once, with the baseline flags (ops, dispatch)

    @property
    def label(self) -> str:
        return self.source.stem + (f" [{self.isa.name}]" if self.isa else "")


@dataclass(frozen=True)
class LibrarySpec:
    csrc: Path
    isas: tuple[Isa, ...]
    cache_root: Path

    def jobs(self) -> list[Job]:
        neutral = sorted(self.csrc.glob("*.cpp")) + sorted((self.csrc / "ops").glob("*.cpp"))
        per_isa = sorted((self.csrc / "kernels").glob("*.cpp"))
        # Link order matters: the baseline objects first, then the ISAs lowest first, so an
        # inline function two objects share comes from the lowest ISA that uses it.
        jobs = [Job(s, None) for s in neutral]
        jobs += [Job(s, isa) for isa in self.isas for s in per_isa]
        return jobs


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def _common_flags(spec: LibrarySpec) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-fopenmp",
             "-Wno-psabi", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{spec.csrc}"]
    # Real paths: the same torch reached through a symlinked site-packages (a test session's
    # venv) gives the same flags, hence the same cache key and no second build.
    for path in cpp_extension.include_paths():
        flags += ["-isystem", os.path.realpath(path)]
    return flags


def job_flags(spec: LibrarySpec, job: Job) -> list[str]:
    flags = _common_flags(spec)
    if job.source.name == DISPATCH_SOURCE:
        # The dispatch tables list the ISA copies this library holds; no other object
        # depends on that list, so a library of more copies reuses the others' objects.
        flags += [f"-DPLUGSERVE_BUILT_{isa.name}" for isa in spec.isas]
    flags += SOURCE_FLAGS.get(job.source.name, ())
    if job.isa is not None:
        flags += [*job.isa.flags, *job.isa.macros]
        for opt in job.isa.opt_ins:
            extra = (*job.isa.flags, *opt.flags)
            if opt.source == job.source.name and compiler_accepts(
                extra, opt.probe, spec.cache_root / "probes"
            ):
                flags += [*opt.flags, f"-D{opt.macro}"]
    return flags


_accepts: dict[tuple[str, tuple[str, ...], str], bool] = {}


def compiler_accepts(flags: tuple[str, ...], probe: str, cache_dir: Path | None = None) -> bool:
    """Whether the compiler (and assembler) build `probe` with `flags` (an older toolchain
    without an instruction set's flags still builds the rest). Asked once per process; with
    `cache_dir` the answer is also kept there, keyed by the compiler's identity, the flags
    and the probe, so later starts do not compile the probe again (~0.2 s each)."""
    key = (compiler(), flags, probe)
    if key in _accepts:
        return _accepts[key]
    answer_file: Path | None = None
    if cache_dir is not None:
        digest = hashlib.sha256("\0".join((_compiler_identity(), *key[:1], *flags, probe))
                                .encode()).hexdigest()[:24]
        answer_file = cache_dir / f"{digest}.accepts"
        try:
            _accepts[key] = answer_file.read_text().strip() == "yes"
            return _accepts[key]
        except OSError:
            pass
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text(probe)
        cmd = [compiler(), *flags, "-c", str(source), "-o", str(Path(tmp) / "probe.o")]
        try:
            out = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
            _accepts[key] = out.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _accepts[key] = False
    if answer_file is not None:
        try:  # written whole or not at all: a killed start leaves no half answer
            answer_file.parent.mkdir(parents=True, exist_ok=True)
            partial = answer_file.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text("yes\n" if _accepts[key] else "no\n")
            partial.replace(answer_file)
        except OSError:
            pass
    return _accepts[key]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    flags = ["-shared", "-fopenmp"]
    for path in cpp_extension.library_paths():
        flags.append(f"-L{os.path.realpath(path)}")
    return [*flags, "-lc10", "-ltorch_cpu", "-ltorch"]


def _compiler_identity() -> str:
    return _identity_of(compiler())


@functools.cache
def _identity_of(cxx: str) -> str:
    """The first line of `cxx --version` (asked once per process and compiler)."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.TimeoutExpired):
        return cxx


def _headers_digest(csrc: Path) -> str:
    digest = hashlib.sha256()
    for header in sorted(csrc.rglob("*.h")):
        digest.update(str(header.relative_to(csrc)).encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()


def library_key(spec: LibrarySpec) -> tuple[str, dict[Job, str]]:
    """The library's cache key and each job's object key: digests of the sources, every
    header, the flags, the compiler and torch."""
    import torch

    base = hashlib.sha256()
    for part in (_compiler_identity(), torch.__version__, sys.version, _headers_digest(spec.csrc)):
        base.update(part.encode())
    object_keys: dict[Job, str] = {}
    for job in spec.jobs():
        digest = base.copy()
        digest.update(job.source.read_bytes())
        digest.update("\0".join(job_flags(spec, job)).encode())
        object_keys[job] = digest.hexdigest()[:24]
    whole = hashlib.sha256("\0".join(object_keys.values()).encode())
    whole.update("\0".join(_link_flags()).encode())
    return whole.hexdigest()[:16], object_keys


def max_jobs() -> int:
    value = os.environ.get("MAX_JOBS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, os.cpu_count() or 1)


def library_path(spec: LibrarySpec, key: str) -> Path:
    return spec.cache_root / key / f"{LIBRARY}.so"


def build_library(spec: LibrarySpec, status: BuildStatus) -> Path:
    """The library for `spec`, built first when the cache has none (see the module doc)."""
    from filelock import FileLock, Timeout

    key, object_keys = library_key(spec)
    target = library_path(spec, key)
    if target.exists():
        return target
    spec.cache_root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(spec.cache_root / ".build.lock"))
    owner_file = spec.cache_root / ".build.owner"
    waited_since = time.monotonic()
    while True:
        try:
            lock.acquire(timeout=2.0)
            break
        except Timeout:
            status.waiting(_read_owner(owner_file), time.monotonic() - waited_since)
            if time.monotonic() - waited_since > LOCK_WAIT_S:
                raise BuildError(
                    f"another process ({_read_owner(owner_file)}) has been building the CPU "
                    f"kernels in {spec.cache_root} for over {LOCK_WAIT_S:.0f} s; stop it or "
                    "set TORCH_EXTENSIONS_DIR to another folder"
                ) from None
    try:
        if target.exists():  # built by the process we waited for
            return target
        owner_file.write_text(f"pid {os.getpid()} on {os.uname().nodename}\n")
        _remove_abandoned(spec.cache_root)
        return _build_locked(spec, key, object_keys, target, status)
    finally:
        lock.release()


def _read_owner(owner_file: Path) -> str:
    try:
        return owner_file.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _remove_abandoned(root: Path) -> None:
    """Folders of builds that died (we hold the lock, so no live build owns one)."""
    for folder in root.glob(".build-*"):
        shutil.rmtree(folder, ignore_errors=True)


def _build_locked(spec: LibrarySpec, key: str, object_keys: dict[Job, str], target: Path,
                  status: BuildStatus) -> Path:
    objects_dir = spec.cache_root / "objects"
    objects_dir.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=spec.cache_root))
    jobs = spec.jobs()
    todo = [j for j in jobs if not (objects_dir / f"{object_keys[j]}.o").exists()]
    # Longest first (the source size is a fair guess), so the last job to finish is short.
    todo.sort(key=lambda j: -j.source.stat().st_size)
    started = time.monotonic()
    status.begin(len(todo), len(jobs) - len(todo), [isa.name for isa in spec.isas], started)
    errors: list[str] = []
    errors_lock = threading.Lock()

    def compile_one(job: Job) -> None:
        if errors:
            return
        status.job_started(job.label)
        begun = time.monotonic()
        tmp = work / f"{object_keys[job]}.o"
        cmd = [compiler(), *job_flags(spec, job), "-c", str(job.source), "-o", str(tmp)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            with errors_lock:
                errors.append(f"{job.label}:\n{_tail(out.stderr)}")
            status.job_failed(job.label)
            return
        os.replace(tmp, objects_dir / f"{object_keys[job]}.o")
        status.job_done(job.label, time.monotonic() - begun)

    with ThreadPoolExecutor(max_workers=max_jobs()) as pool:
        list(pool.map(compile_one, todo))
    if errors:
        shutil.rmtree(work, ignore_errors=True)
        raise BuildError("compiling the CPU kernels failed:\n" + "\n".join(errors))
    status.linking()
    staged = work / key
    staged.mkdir()
    objects = [str(objects_dir / f"{object_keys[j]}.o") for j in jobs]
    cmd = [compiler(), *objects, *_link_flags(), "-o", str(staged / target.name)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise BuildError(f"linking the CPU kernels failed:\n{_tail(out.stderr)}")
    os.replace(staged, target.parent)  # one rename: the library appears whole or not at all
    shutil.rmtree(work, ignore_errors=True)
    status.end(time.monotonic() - started, target)
    return target


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
