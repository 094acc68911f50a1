"""Registers the `fa3` attention backend; nothing heavy is imported here."""

from __future__ import annotations

from typing import Any

from plugserve.attention.base import BackendCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterAttentionBackend

CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16"}),
)


def _load() -> Any:
    from plugserve_attention_fa3.backend import load_backend

    return load_backend()


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        "fa3",
        _load,
        CAPABILITIES,
        description="FlashAttention 3 kernels; CUDA, bf16/fp16 (install the [cuda] extra)",
    )
