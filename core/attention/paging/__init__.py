"""Paging helpers every attention backend shares: page lists, decode KV lists, windows.

A small package, one concept a module (`pages`, `kv_lists`, `decode`, `windows`).

One copy of what page-table backends (flashinfer, fa3), slot-list backends (triton) and the
reference (torch_native) all need to turn a `ForwardBatch` into index tables:

- `indptr_from_lengths`, `pages_for`: offsets from lengths; pages a list of tokens covers.
- `PageLists`, `row_page_lists`, `kv_list_page_lists`: which page holds each page-sized chunk
  of a KV list, for lists that are request rows (`req_to_token[row, :length]`) or the
  per-branch draft KV lists of a topk>1 draft decode (`plugserve.attention.draft_kv`). The
  same entries give a FlashInfer-style `kv_indices` (page ids list after list) and an
  FA3-style page-table row (`owner`, `column`).
- `gather_row_slots`: the slots of request rows, list after list (slot-list backends).
- `DraftKVLists` (`kv_lists`): a draft decode's per-branch KV lists as the spec plugin stored
  them in `forward_batch.extra` (the contract: `plugserve.attention.draft_kv`).
- `decode_draft_lists`, `decode_slot_lists`, `decode_page_lists` (`decode`): the decode
  dispatch: the per-branch KV lists when the spec plugin stored them, else one query per
  request reading its row (anything else is refused with what to do).
- `window_mask_by_position`, `fold_window_into_mask`: a sliding window measured in token
  positions, the rule of a tree verify (a node at depth d sits at `prefix + d`).
"""

from __future__ import annotations

from plugserve.attention.paging.decode import (
    decode_draft_lists,
    decode_page_lists,
    decode_slot_lists,
)
from plugserve.attention.paging.kv_lists import DRAFT_KV_KEYS, DraftKVLists
from plugserve.attention.paging.pages import (
    PageLists,
    gather_row_slots,
    indptr_from_lengths,
    kv_list_lengths,
    kv_list_page_lists,
    pages_for,
    row_page_lists,
)
from plugserve.attention.paging.windows import fold_window_into_mask, window_mask_by_position

__all__ = [
    "DRAFT_KV_KEYS",
    "DraftKVLists",
    "PageLists",
    "decode_draft_lists",
    "decode_page_lists",
    "decode_slot_lists",
    "fold_window_into_mask",
    "gather_row_slots",
    "indptr_from_lengths",
    "kv_list_lengths",
    "kv_list_page_lists",
    "pages_for",
    "row_page_lists",
    "window_mask_by_position",
]
