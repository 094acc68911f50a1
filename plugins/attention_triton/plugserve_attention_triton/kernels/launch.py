"""One kernel launch as data: the kernel, its grid, its arguments and its launch options.

The launchers (`extend_launch`, `decode_launches`) build these from the batch's tensors and
the target's compute capability; `run()` launches. `compile()` hands the same arguments to
Triton's own launch path with `warmup=True`: Triton's binder specialises them exactly as the
launch would (divisibility-by-16 hints on pointers and integers, integers equal to 1 as
constants) and compiles that kernel, or finds it in Triton's cache, without running it.
That is how the engine warms its kernels at start-up and how the CUDA compile check
(`tests/cuda_compile_check.py`) compiles, on a host without a GPU, what a launch compiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a triton JITFunction (compiled) or InterpretedFunction (CPU interpreter)
    grid: tuple[int, ...]
    args: tuple[object, ...]
    # Constexpr parameters and Triton launch options (num_warps, num_stages).
    options: dict[str, object] = field(default_factory=dict)

    @property
    def kernel_name(self) -> str:
        return str(getattr(self.kernel, "__name__", self.kernel))

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)

    def compile(self) -> Any:
        """The compiled kernel `run()` would launch on the current device (Triton's
        `CompiledKernel`), compiled now if Triton has not compiled it yet; nothing runs."""
        return self.kernel.run(*self.args, grid=self.grid, warmup=True, **self.options)


@functools.cache
def _cuda_capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def kernel_arch(kernel: object, device: torch.device) -> int | None:
    """The compute capability `kernel` is compiled for on `device` (80 for sm_80), or None
    when it runs in Triton's CPU interpreter (decided when it was decorated)."""
    if type(kernel).__name__ == "InterpretedFunction" or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index)
