"""What the FA3 backend supports, as data (light: no flash-attn import).

`VERIFIED_ON` records the last GPU run of the conformance tests. Until one has passed, the
registration says so in its notes and `plugserve plugins` shows it, so the capabilities below
read as a claim, not as something proven (the page>1+topk>1 whitelist keeps naming the backend).
"""

from __future__ import annotations

from plugserve.attention.base import BackendCapabilities

# None = never verified on a GPU. Set it after a passing run, e.g.
# "H200, 2026-11-23, conformance suite passed".
VERIFIED_ON: str | None = None

GPU_CHECK = "plugserve conformance --attention fa3 --device cuda"


def verification_note(verified_on: str | None) -> str:
    """The first note of the registration: verified where and when, or how to verify."""
    if verified_on is None:
        return f"not verified on a GPU yet: run `{GPU_CHECK}`"
    return f"verified on a GPU: {verified_on}"


CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16"}),
    page_sizes=None,  # FA3 takes any page_block_size, 1 included
    custom_mask=True,  # tree verify: prefix pages + per-token tree keys, merged by LSE
    topk_gt1=True,  # one page-table row per branch
    sliding_window=True,  # window_size; a tree verify's windowed layers go by slots
    notes=(
        verification_note(VERIFIED_ON),
        "metadata (page_table, cache_seqlens, cu_seqlens_q, the tree part of a verify) is "
        "plain torch and checked on CPU against torch_native through a CPU interpreter of "
        "flash_attn_with_kvcache (reference.py)",
    ),
)
