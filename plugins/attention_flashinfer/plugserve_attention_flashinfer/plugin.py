"""Registers the `flashinfer` attention backend and its fix toggles; nothing heavy is imported.

The loader imports the backend module (plain torch) and checks CUDA, the flashinfer package
and a way to get its kernels; flashinfer itself is imported only there, when the backend is
selected. `plugserve plugins` runs `environment.unavailable_reason`, which imports nothing.
"""

from __future__ import annotations

from typing import Any

from plugserve.attention.registration import backend_plugin_hooks
from plugserve_attention_flashinfer.capabilities import CAPABILITIES
from plugserve_attention_flashinfer.environment import unavailable_reason
from plugserve_attention_flashinfer.fixes import FIX_TOGGLES

BACKEND_NAME = "flashinfer"


def _load() -> Any:
    from plugserve_attention_flashinfer.backend import load_backend

    return load_backend()


plugserve_register_attention_backends, plugserve_register_fix_toggles = backend_plugin_hooks(
    BACKEND_NAME, _load, CAPABILITIES,
    description="FlashInfer paged prefill/decode wrappers: tree masks, topk>1 drafting, "
    "sliding window; CUDA, bf16/fp16 (install the [cuda] extra)",
    fix_toggles=FIX_TOGGLES, availability=unavailable_reason,
)
