"""Registers the `fa3` attention backend and its fix toggle; nothing heavy is imported.

The loader imports the backend module (plain torch) and checks CUDA and an FA3 build
(`flash_attn_interface` or `sgl_kernel.flash_attn`) that loads with this torch; those are
imported only there, when the backend is selected. `plugserve plugins` runs
`environment.unavailable_reason`, which imports neither.
"""

from __future__ import annotations

from typing import Any

from plugserve.attention.registration import backend_plugin_hooks
from plugserve_attention_fa3.capabilities import CAPABILITIES
from plugserve_attention_fa3.environment import unavailable_reason
from plugserve_attention_fa3.fixes import FIX_TOGGLES

BACKEND_NAME = "fa3"


def _load() -> Any:
    from plugserve_attention_fa3.backend import load_backend

    return load_backend()


plugserve_register_attention_backends, plugserve_register_fix_toggles = backend_plugin_hooks(
    BACKEND_NAME, _load, CAPABILITIES,
    description="FlashAttention 3 flash_attn_with_kvcache over a page table: tree verify, "
    "topk>1 drafting, sliding window; CUDA, bf16/fp16 (install the [cuda] extra)",
    fix_toggles=FIX_TOGGLES, availability=unavailable_reason,
)
