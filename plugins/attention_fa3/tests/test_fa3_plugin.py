"""Registration: capabilities with the not-verified note, the fix toggles, lazy imports, and
a backend that refuses to run FA3's CUDA kernels anywhere else (the shared cases of
`plugserve.testing.backend_registration`)."""

from __future__ import annotations

from pathlib import Path

from plugserve.testing.backend_registration import BackendRegistrationCases
from plugserve_attention_fa3 import capabilities, plugin
from plugserve_attention_fa3.backend import FA3AttentionBackend
from plugserve_attention_fa3.environment import unavailable_reason
from plugserve_attention_fa3.fixes import DRAFT_PAGE_SCATTER


class TestFA3Registration(BackendRegistrationCases):
    attention = "fa3"
    distribution = "plugserve-attention-fa3"
    plugin_module = plugin
    capabilities_module = capabilities
    backend_cls = FA3AttentionBackend
    availability = staticmethod(unavailable_reason)
    fix_toggles = (DRAFT_PAGE_SCATTER,)
    kernel_modules = frozenset({"flash_attn_interface", "sgl_kernel", "flash_attn"})
    plugin_root = Path(__file__).resolve().parents[1]
    expected_capabilities = {"dtypes": frozenset({"bfloat16", "float16"})}
