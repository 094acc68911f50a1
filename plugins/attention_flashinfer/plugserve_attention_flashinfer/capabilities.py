"""What the FlashInfer backend supports, as data (light: no flashinfer import).

`VERIFIED_ON` records the last GPU run of the conformance tests. Until one has passed, the
registration says so in its notes and `plugserve plugins` shows it, so the capabilities below
read as a claim, not as something proven (the page>1+topk>1 whitelist keeps naming the backend).
"""

from __future__ import annotations

from plugserve.attention.base import BackendCapabilities

# None = never verified on a GPU. Set it after a passing run, e.g.
# "H200, 2026-11-23, conformance suite passed".
VERIFIED_ON: str | None = None

GPU_CHECK = "plugserve conformance --attention flashinfer --device cuda"


def verification_note(verified_on: str | None) -> str:
    """The first note of the registration: verified where and when, or how to verify."""
    if verified_on is None:
        return f"not verified on a GPU yet: run `{GPU_CHECK}`"
    return f"verified on a GPU: {verified_on}"


CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16"}),
    page_sizes=None,  # page tables name pages of any size
    custom_mask=True,  # tree verify through the prefill wrapper's custom_mask
    topk_gt1=True,  # one decode-wrapper entry per branch
    sliding_window=True,  # window_left, one planned wrapper per window
    notes=(
        verification_note(VERIFIED_ON),
        "metadata (qo_indptr, kv_indptr, kv_indices as page ids, kv_last_page_len, custom "
        "mask) is plain torch and checked on CPU against torch_native through a CPU "
        "interpreter of FlashInfer's layout (reference.py)",
    ),
)
