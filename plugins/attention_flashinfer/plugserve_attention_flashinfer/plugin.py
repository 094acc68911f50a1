"""Registers the `flashinfer` attention backend and its fix toggle; nothing heavy is imported.

The loader imports the backend module (plain torch) and checks CUDA and the flashinfer
package; flashinfer itself is imported only there, when the backend is selected.
"""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterAttentionBackend, RegisterFixToggle
from plugserve_attention_flashinfer.capabilities import CAPABILITIES
from plugserve_attention_flashinfer.fixes import FIX_TOGGLES

BACKEND_NAME = "flashinfer"


def _load() -> Any:
    from plugserve_attention_flashinfer.backend import load_backend

    return load_backend()


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        BACKEND_NAME,
        _load,
        CAPABILITIES,
        description="FlashInfer paged prefill/decode wrappers: tree masks, topk>1 drafting, "
        "sliding window; CUDA, bf16/fp16 (install the [cuda] extra)",
    )


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    for name, description in FIX_TOGGLES.items():
        register(name, description)
