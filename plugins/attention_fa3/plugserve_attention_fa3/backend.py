"""Loader of the `fa3` backend: checks CUDA and the flash-attn package first.

The kernel wrappers are a later issue: once both checks pass, loading still stops with a
clear "not built yet" error rather than running anything.
"""

from __future__ import annotations

import torch

from plugserve.attention.base import AttentionBackend

INSTALL_HINT = "pip install 'plugserve-attention-fa3[cuda]'"


def load_backend() -> type[AttentionBackend]:
    """The backend class; raises a clear error when this machine cannot run it."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "attention backend 'fa3' requires CUDA, but torch sees no CUDA device; "
            "use --attention torch_native on this machine"
        )
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"attention backend 'fa3' needs the flash-attn package ({exc}); {INSTALL_HINT}"
        ) from exc
    raise RuntimeError(
        "attention backend 'fa3' is not built yet (its kernel wrappers are a later issue); "
        "use --attention torch_native or triton"
    )
