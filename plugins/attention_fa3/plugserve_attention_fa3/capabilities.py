"""What the FA3 backend supports, as data (light: nothing of FA3 is imported).

`VERIFIED_ON` (the first note, `gpu_verification_note`): where a GPU run of the conformance
suite passed; None until one has.
"""

from __future__ import annotations

from plugserve.attention.capabilities import BackendCapabilities, gpu_verification_note

VERIFIED_ON: str | None = None

CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16"}),
    page_sizes=None,  # FA3 takes any page_block_size, 1 included
    custom_mask=True,  # tree verify: prefix pages + per-token tree keys, merged by LSE
    topk_gt1=True,  # one page-table row per branch
    sliding_window=True,  # window_size; a tree verify's windowed layers go by slots
    notes=(
        gpu_verification_note("fa3", VERIFIED_ON),
        "metadata and calls are checked on CPU: against torch_native through an interpreter "
        "of flash_attn_with_kvcache (reference.py), and against the pinned sgl-kernel's "
        "signature (tests/test_fa3_api.py)",
    ),
)
