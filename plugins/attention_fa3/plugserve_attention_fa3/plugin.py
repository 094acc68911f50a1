"""Registers the `fa3` attention backend and its fix toggle; nothing heavy is imported.

The loader imports the backend module (plain torch) and checks CUDA and an FA3 build
(`flash_attn_interface` or `sgl_kernel.flash_attn`); those are imported only there, when the
backend is selected.
"""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterAttentionBackend, RegisterFixToggle
from plugserve_attention_fa3.capabilities import CAPABILITIES
from plugserve_attention_fa3.fixes import FIX_TOGGLES

BACKEND_NAME = "fa3"


def _load() -> Any:
    from plugserve_attention_fa3.backend import load_backend

    return load_backend()


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        BACKEND_NAME,
        _load,
        CAPABILITIES,
        description="FlashAttention 3 flash_attn_with_kvcache over a page table: tree "
        "verify, topk>1 drafting, sliding window; CUDA, bf16/fp16 (install the [cuda] extra)",
    )


@hookimpl
def plugserve_register_fix_toggles(register: RegisterFixToggle) -> None:
    for name, description in FIX_TOGGLES.items():
        register(name, description)
