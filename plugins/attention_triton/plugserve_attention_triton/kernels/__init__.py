"""The Triton kernels. Import this package only through `runtime.prepare_triton_runtime`
(the CUDA compile check, `tests/cuda_compile_check.py`, imports it in a process of its own
without the interpreter, to compile it for CUDA targets).

Whether the kernels are compiled for CUDA or run by Triton's CPU interpreter is fixed when
this package is first imported (Triton reads `TRITON_INTERPRET` when `@triton.jit` runs);
`INTERPRETED` records that choice for the rest of the process.
"""

from __future__ import annotations

from plugserve_attention_triton.runtime import interpreter_requested

INTERPRETED: bool = interpreter_requested()

from plugserve_attention_triton.kernels.decode import decode_attention, decode_launches  # noqa: E402
from plugserve_attention_triton.kernels.extend import extend_attention, extend_launch  # noqa: E402
from plugserve_attention_triton.kernels.launch import KernelLaunch  # noqa: E402
from plugserve_attention_triton.kernels.warmup import warm_up  # noqa: E402

__all__ = [
    "INTERPRETED",
    "KernelLaunch",
    "decode_attention",
    "decode_launches",
    "extend_attention",
    "extend_launch",
    "warm_up",
]
