"""Compile Triton kernels for a CUDA target on a host without a GPU, and read ptxas's figures.

`compile_only(arch)` installs a driver that answers Triton's launch path for
`GPUTarget("cuda", arch, 32)`; a `KernelLaunch.compile()` inside it then binds, specialises and
compiles exactly as a launch on that GPU would, with Triton's bundled ptxas.
`compile_with_figures` adds ptxas's own report (registers, spill stores and loads, stack),
cached beside Triton's cache entry. Used by `cuda_compile_check.py`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


class CompileOnlyDriver:
    """What Triton's launch path asks the active driver, answered for a target with no
    device: the target, a device id (the arch, so each target keeps its own binder and kernel
    cache) and a stream. Nothing is ever loaded or launched through it."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return int(self.target.arch)

    def get_current_stream(self, device: int) -> int:
        return 0


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[None]:
    config = triton.runtime.driver
    previous = config._active  # None until something asked for a driver
    config.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))  # type: ignore[arg-type]
    try:
        yield
    finally:
        config._active = previous


def ptxas_usable() -> str | None:
    """None when Triton's bundled ptxas runs here, else why not."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
        subprocess.run([ptxas, "--version"], check=True, capture_output=True, timeout=60)
    except Exception as exc:  # any failure means: no toolchain on this host
        return f"{type(exc).__name__}: {exc}"
    return None



def _figures_path(kernel_hash: str) -> Path:
    return Path(knobs.cache.dir) / "plugserve-ptxas" / f"{kernel_hash}.json"


def _parse_ptxas(log: str) -> dict[str, int] | None:
    registers, frame = _PTXAS_REGISTERS.search(log), _PTXAS_FRAME.search(log)
    if registers is None or frame is None:
        return None
    stack, stores, loads = (int(x) for x in frame.groups())
    return {"registers": int(registers.group(1)), "spill_stores": stores,
            "spill_loads": loads, "stack_bytes": stack}


def _compile_logged(launch: object, *, always: bool) -> tuple[object, str]:
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = always
        kernel = launch.compile()  # type: ignore[attr-defined]
    return kernel, log.getvalue()


def compile_with_figures(
    launch: object, seen: dict[str, dict[str, int]]
) -> tuple[object, dict[str, int]]:
    """Compile through Triton's launch path; ptxas's own report gives the figures. A launch
    that specialises like an earlier one gets that kernel from Triton's in-process cache
    (`seen` has its figures); one Triton cached on disk in an earlier run has its figures in
    our file beside it, and if that is gone it is compiled once more."""
    kernel, log = _compile_logged(launch, always=False)
    figures = _parse_ptxas(log)
    if figures is None:
        path = _figures_path(kernel.hash)
        if kernel.hash in seen:
            return kernel, seen[kernel.hash]
        if path.exists():
            figures = json.loads(path.read_text())
        else:
            launch.kernel.device_caches.clear()  # type: ignore[attr-defined]
            kernel, log = _compile_logged(launch, always=True)
            figures = _parse_ptxas(log)
            if figures is None:
                raise RuntimeError(f"ptxas printed no register report:\n{log[-2000:]}")
    path = _figures_path(kernel.hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures))
    seen[kernel.hash] = figures
    return kernel, figures


