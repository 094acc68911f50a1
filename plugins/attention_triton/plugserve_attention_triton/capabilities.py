"""What the Triton backend supports, as data (light: no Triton import)."""

from __future__ import annotations

from plugserve.attention.base import BackendCapabilities

TRITON_CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    page_sizes=None,  # kernels read slot lists, so any page size and any page order
    custom_mask=True,
    topk_gt1=True,
    sliding_window=True,
    # Windowed layers of a hybrid pool read their own buffer: the batch's KV index table is
    # translated once per batch (backend `init_forward_metadata`).
    swa_slot_translation=True,
    notes=(
        "cpu runs the kernels in the Triton interpreter (TRITON_INTERPRET=1, set "
        "automatically when unset): exact but slow, meant for tests",
        "topk>1 draft decode reads per-branch KV lists from forward_batch.extra "
        "(draft_kv_indptr, draft_kv_indices, draft_kv_lens_cpu; see draft_kv)",
    ),
)
