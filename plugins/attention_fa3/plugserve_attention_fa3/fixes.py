"""The fix toggles this plugin owns (`PLUGSERVE_REVERT_FIX=name` puts the old bug back).

Light on purpose: the plugin module registers these names at plugin load, before the backend
is imported.
"""

from __future__ import annotations

# SGLang PR 27360: the per-branch page rows of a topk>1 draft decode were filled with more
# pages than the step-tight table has columns, and the scatter wrote out of bounds.
DRAFT_PAGE_SCATTER = "fa3_draft_page_scatter_oob"

FIX_TOGGLES = {
    DRAFT_PAGE_SCATTER: "fa3: fill each branch's page-table row with every distinct page its "
    "KV list touches (the prefix's original tail page and the branch's own first page) "
    "instead of one page per page-sized chunk; with page_size>1 and a partial tail the "
    "scatter writes past the step-tight row (SGLang PR 27360)",
}
