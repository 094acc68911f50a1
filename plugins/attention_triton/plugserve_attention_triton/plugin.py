"""plugserve plugin: registers the "triton" attention backend.

Light on purpose: importing this module imports neither Triton nor the kernels. The loader
returns the backend class; the kernels are imported when the backend is built for a device
(`runtime.prepare_triton_runtime`).
"""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve_attention_triton.capabilities import TRITON_CAPABILITIES

BACKEND_NAME = "triton"


def load_backend() -> Any:
    from plugserve_attention_triton.backend import TritonAttentionBackend

    return TritonAttentionBackend


@hookimpl
def plugserve_register_attention_backends(register: Any) -> None:
    register(
        BACKEND_NAME,
        load_backend,
        TRITON_CAPABILITIES,
        description="Triton kernels over the paged KV cache: any page size, tree masks, "
        "topk>1 drafting, sliding window; CUDA compiled or CPU interpreter",
    )
