"""A test plugin that registers an attention backend under the built-in name `torch_native`."""

from __future__ import annotations

from typing import Any

from plugserve.attention.base import BackendCapabilities
from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterAttentionBackend


def _backend() -> Any:
    from plugserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend


@hookimpl
def plugserve_register_attention_backends(register: RegisterAttentionBackend) -> None:
    register("torch_native", _backend, BackendCapabilities(), description="a second torch_native")
