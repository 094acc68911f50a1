"""A CPU-kernel build killed at any point (kill -9) never blocks the next start: the builder's
lock is an flock the kernel drops with its owner, and the library is linked in a private
folder and moved into place with one rename, so the next build removes the dead one's folder
and finishes. Built from a one-line source, so the test costs seconds."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plugserve.kernels import compile as compile_mod
from plugserve.kernels.status import Silent

WAIT_S = 60.0


class Recording(Silent):
    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.ready: Path | None = None

    def job_done(self, label: str, seconds: float) -> None:
        self.compiled.append(label)

    def end(self, seconds: float, path: Path) -> None:
        self.ready = path


def _spec(tmp_path: Path) -> compile_mod.LibrarySpec:
    csrc = tmp_path / "csrc"
    (csrc / "ops").mkdir(parents=True)
    (csrc / "kernels").mkdir()
    (csrc / "answer.cpp").write_text(
        'extern "C" __attribute__((visibility("default"))) int plugserve_answer() '
        "{ return 42; }\n"
    )
    return compile_mod.LibrarySpec(csrc, (), tmp_path / "cache")


def _slow_compiler(tmp_path: Path, started: Path) -> Path:
    """A compiler that says it started and then hangs on every compile (not on --version, so
    the cache key is the real compiler's)."""
    script = tmp_path / "slow-c++"
    real = shutil.which(compile_mod.compiler())
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -c "*) touch {started}; sleep {WAIT_S:.0f};; esac
        exec {real} "$@"
    """))
    script.chmod(0o755)
    return script


def test_a_killed_build_does_not_block_the_next(tmp_path: Path) -> None:
    if shutil.which(compile_mod.compiler()) is None:
        pytest.skip("no C++ compiler")
    spec = _spec(tmp_path)
    started = tmp_path / "compile-started"
    code = textwrap.dedent(f"""\
        from pathlib import Path
        from plugserve.kernels import compile as c
        from plugserve.kernels.status import Silent
        spec = c.LibrarySpec(Path({str(spec.csrc)!r}), (), Path({str(spec.cache_root)!r}))
        c.build_library(spec, Silent())
    """)
    env = {**os.environ, "CXX": str(_slow_compiler(tmp_path, started))}
    builder = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not started.exists() and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the first build never reached its compile step"
        os.killpg(builder.pid, signal.SIGKILL)  # the builder and its compiler, mid-compile
        builder.wait(timeout=WAIT_S)
    finally:
        if builder.poll() is None:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait(timeout=WAIT_S)
    root = spec.cache_root
    assert (root / ".build.lock").exists() and list(root.glob(".build-*")), (
        "the killed build should have left its lock file and its private folder"
    )
    key, _ = compile_mod.library_key(spec)
    assert not compile_mod.library_path(spec, key).exists()

    status = Recording()
    begun = time.monotonic()
    path = compile_mod.build_library(spec, status)
    assert time.monotonic() - begun < WAIT_S / 2  # did not wait on the dead builder
    assert path == compile_mod.library_path(spec, key) and status.ready == path
    assert status.compiled == ["answer"]
    assert not list(root.glob(".build-*"))  # the dead build's folder is gone
    assert ctypes.CDLL(str(path)).plugserve_answer() == 42  # a whole library
    # A later start finds it and compiles nothing.
    again = Recording()
    assert compile_mod.build_library(spec, again) == path and again.compiled == []
