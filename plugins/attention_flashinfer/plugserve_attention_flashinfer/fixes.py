"""The fix toggles this plugin owns (`PLUGSERVE_REVERT_FIX=name` puts the old bug back).

Light on purpose: the plugin module registers these names at plugin load, before the backend
(or torch work of any kind) is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugserve.attention.base import AttentionContext

# SGLang PR 27338: the draft-decode page-index buffer was sized for max_batch_size lists,
# but a topk>1 draft decode packs topk lists (prefix + branch path) per request.
DRAFT_INDICES_TOPK_FACTOR = "flashinfer_draft_indices_topk_factor"

FIX_TOGGLES = {
    DRAFT_INDICES_TOPK_FACTOR: "flashinfer: size the persistent kv_indices buffer without the "
    "topk factor (max_batch_size x pages per row); a topk>1 draft decode of a full batch "
    "needs topk page lists per request and overflows it (SGLang PR 27338)",
}


def resolve_reverts(ctx: AttentionContext, explicit: Iterable[str] | None) -> frozenset[str]:
    """The toggles a backend honours: `explicit` when given (tests), else the engine's
    start-up choice carried by the context (`AttentionContext.revert_fixes`)."""
    if explicit is not None:
        return frozenset(explicit)
    return ctx.revert_fixes
