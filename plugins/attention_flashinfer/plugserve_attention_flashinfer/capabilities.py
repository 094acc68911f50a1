"""What the FlashInfer backend supports, as data (light: nothing of FlashInfer is imported).

`VERIFIED_ON` (the first note, `gpu_verification_note`): where a GPU run of the conformance
suite passed; None until one has.
"""

from __future__ import annotations

from plugserve.attention.capabilities import BackendCapabilities, gpu_verification_note

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
