"""The fix toggles this plugin owns (`PLUGSERVE_REVERT_FIX=name` puts the old bug back).

Light on purpose: the plugin module registers these names at plugin load, before the backend
(or torch work of any kind) is imported.
"""

from __future__ import annotations

# SGLang PR 27338: the draft-decode page-index buffer was sized for max_batch_size lists,
# but a topk>1 draft decode packs topk lists (prefix + branch path) per request.
DRAFT_INDICES_TOPK_FACTOR = "flashinfer_draft_indices_topk_factor"
# Causal extends and masked tree verifies shared one prefill wrapper (cached by window and
# scale only). FlashInfer's `auto` backend is chosen at a wrapper's first plan(): on sm90
# with bf16/fp16 and head_dim 64/128/256 a causal extend picks fa3 and a later
# plan(custom_mask=...) keeps it; run() then launches the SM90 kernel with a mask, which
# FlashInfer refuses (a crash on the first EAGLE verify after an extend).
SHARED_PREFILL_WRAPPER = "flashinfer_shared_prefill_wrapper"

FIX_TOGGLES = {
    DRAFT_INDICES_TOPK_FACTOR: "flashinfer: size the persistent kv_indices buffer without the "
    "topk factor (max_batch_size x pages per row); a topk>1 draft decode of a full batch "
    "needs topk page lists per request and overflows it (SGLang PR 27338)",
    SHARED_PREFILL_WRAPPER: "flashinfer: causal extends and masked tree verifies share one "
    "prefill wrapper with backend 'auto'; on sm90 the first extend fixes it to fa3 and the "
    "next verify runs fa3 with a custom mask, which FlashInfer refuses",
}
