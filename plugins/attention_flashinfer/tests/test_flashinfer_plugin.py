"""Registration: capabilities with the not-verified note, the fix toggles, lazy imports, and
a backend that refuses to run FlashInfer's CUDA kernels anywhere else (the shared cases of
`plugserve.testing.backend_registration`)."""

from __future__ import annotations

from pathlib import Path

from plugserve.testing.backend_registration import BackendRegistrationCases
from plugserve_attention_flashinfer import capabilities, plugin
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend
from plugserve_attention_flashinfer.environment import unavailable_reason
from plugserve_attention_flashinfer.fixes import DRAFT_INDICES_TOPK_FACTOR, SHARED_PREFILL_WRAPPER


class TestFlashInferRegistration(BackendRegistrationCases):
    attention = "flashinfer"
    distribution = "plugserve-attention-flashinfer"
    plugin_module = plugin
    capabilities_module = capabilities
    backend_cls = FlashInferAttentionBackend
    availability = staticmethod(unavailable_reason)
    fix_toggles = (DRAFT_INDICES_TOPK_FACTOR, SHARED_PREFILL_WRAPPER)
    kernel_modules = frozenset({"flashinfer"})
    plugin_root = Path(__file__).resolve().parents[1]
    expected_capabilities = {"swa_slot_translation": False}  # one plain pool with a window mask
