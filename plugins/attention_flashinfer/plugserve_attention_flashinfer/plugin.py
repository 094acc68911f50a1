"""Registers the `flashinfer` attention backend; nothing heavy is imported here."""

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
    from plugserve_attention_flashinfer.backend import load_backend

    return load_backend()


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        "flashinfer",
        _load,
        CAPABILITIES,
        description="FlashInfer paged-KV kernels; CUDA, bf16/fp16 (install the [cuda] extra)",
    )
