"""What the FlashInfer backend supports, as data (light: no flashinfer import).

`VERIFIED_ON` records the last GPU run of the conformance suite that passed; until there is
one, the first note says so and `plugserve plugins` shows it, so the capabilities below read
as a claim, not as something proven.
"""

from __future__ import annotations

from plugserve.attention.capabilities import BackendCapabilities, gpu_verification_note

# None = no GPU run has passed yet. Set it after one, e.g. "H100, 2026-11-23, conformance".
VERIFIED_ON: str | None = None

CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16"}),
    page_sizes=None,  # page tables name pages of any size
    custom_mask=True,  # tree verify: a prefill wrapper of its own, planned with custom_mask
    topk_gt1=True,  # one decode-wrapper entry per branch
    sliding_window=True,  # window_left, one planned wrapper per window
    notes=(
        gpu_verification_note("flashinfer", VERIFIED_ON),
        "metadata and plan/run calls are checked on CPU: against torch_native through an "
        "interpreter of FlashInfer's wrappers (reference.py), and against the pinned "
        "flashinfer-python's signatures (tests/test_flashinfer_api.py)",
    ),
)
