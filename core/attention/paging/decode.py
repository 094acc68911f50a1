"""The decode dispatch: a draft decode's per-branch KV lists, or one query per request row."""

from __future__ import annotations

from collections.abc import Callable

import torch

from plugserve.attention.paging.kv_lists import DRAFT_KV_KEYS, DraftKVLists
from plugserve.attention.paging.pages import (
    PageLists,
    gather_row_slots,
    indptr_from_lengths,
    kv_list_page_lists,
    row_page_lists,
)
from plugserve.structs.forward_batch import ForwardBatch


def decode_draft_lists(fb: ForwardBatch) -> DraftKVLists | None:
    """A decode batch's per-branch KV lists when the spec plugin stored them (they win, for
    any topk); None when each query is a request reading `req_to_token[row, :seq_len]`,
    which needs one query per request."""
    lists = DraftKVLists.from_batch(fb)
    if lists is None and fb.num_tokens != fb.batch_size:
        raise ValueError(
            f"{fb.mode.value} batch has {fb.num_tokens} queries for {fb.batch_size} requests: "
            "a topk>1 draft decode must give each branch its KV list in forward_batch.extra "
            f"({', '.join(DRAFT_KV_KEYS)}); see plugserve.attention.draft_kv"
        )
    return lists


def decode_slot_lists(fb: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """Every decode query's KV slots as (`kv_indptr_cpu`, int64 `kv_indices` on the device):
    its branch's draft KV list, or its request's row."""
    device = fb.req_to_token.device
    lists = decode_draft_lists(fb)
    if lists is not None:
        return lists.kv_indptr_cpu(), lists.kv_indices.to(device=device, dtype=torch.int64)
    seq_lens = list(fb.seq_lens_cpu)
    return indptr_from_lengths(seq_lens), gather_row_slots(fb.req_to_token,
                                                           fb.req_pool_indices, seq_lens)


ListPager = Callable[[list[int], torch.Tensor, int], PageLists]


def decode_page_lists(
    fb: ForwardBatch, page_size: int, *, list_pager: ListPager = kv_list_page_lists
) -> PageLists:
    """Every decode query's pages: its branch's draft KV list (paged by `list_pager`), or its
    request's row."""
    lists = decode_draft_lists(fb)
    if lists is not None:
        return list_pager(lists.kv_indptr_cpu(), lists.kv_indices.to(fb.req_to_token.device),
                          page_size)
    return row_page_lists(fb.req_to_token, fb.req_pool_indices, list(fb.seq_lens_cpu),
                          page_size)
