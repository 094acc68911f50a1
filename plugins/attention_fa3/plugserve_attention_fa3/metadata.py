"""Per-batch FA3 metadata, built once per batch in plain torch (no CUDA needed).

A batch is one or two `flash_attn_with_kvcache` calls; each `Fa3Call` holds exactly its
arguments (int32 device tensors) with q in the varlen layout `[total_q, heads, head_dim]`:

- `page_table` `[entries, width]`: entry b reads token j from page `page_table[b, j // page]`;
- `cache_seqlens` `[entries]`: tokens entry b reads; `cu_seqlens_q` `[entries + 1]`: its q
  rows; `max_seqlen_q`; `causal` aligns query r of `sq` to KV position `kv_len - sq + r`.

Modes:

- EXTEND / DRAFT_EXTEND (no mask): one causal call, one entry per request over
  `req_to_token[row, :seq_len]`.
- TARGET_VERIFY (tree mask): FA3 takes no mask, so the batch splits in two calls merged by
  their log-sum-exps: `main` = every new token over its request's cached prefix (not causal,
  `cache_seqlens = prefix_len`); `tree` = every new token as its own entry over the tree
  tokens the mask lets it see, read through a page-size-1 view of the pool (`page_table` row
  = those slots). The mask's prefix columns must all be True (a draft tree sees the prefix).
  A layer with a sliding window makes one call instead: every new token over the keys its
  mask row allows within the window, by slots (`windowed_verify`; a tree's window counts
  token positions, which FA3's `window_size`, counting rows, cannot express).
- DECODE / DRAFT_DECODE: one entry per query over a request row or, for topk>1 drafting, a
  branch's KV list: the request's page table expanded per branch (see `pages`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugserve.attention.paging import (
    decode_page_lists,
    indptr_from_lengths,
    kv_list_page_lists,
    row_page_lists,
    window_mask_by_position,
)
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_attention_fa3.page_table import PageTableBuffer
from plugserve_attention_fa3.pages import distinct_page_lists


@dataclass(eq=False)
class Fa3Call:
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    causal: bool
    page_size: int  # page size of the pool view this call reads (1 for a verify's tree part)
    has_keys: torch.Tensor  # bool [total_q]: False where a query's entry reads no token


@dataclass(eq=False)
class Fa3Metadata:
    is_decode: bool
    main: Fa3Call
    tree: Fa3Call | None = None
    table_generation: int = 0  # the page-table buffer's write holding `main.page_table`
    verify: VerifyBlocks | None = None  # a tree verify's masks, for its windowed layers
    windowed: dict[int, Fa3Call] = field(default_factory=dict)  # per window, built on use

    def windowed_verify(self, window: int) -> Fa3Call:
        """The one call a tree verify makes on a layer with sliding window `window`."""
        assert self.verify is not None
        if window not in self.windowed:
            self.windowed[window] = windowed_verify_call(self.verify, window)
        return self.windowed[window]


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


def _call(
    table: torch.Tensor, kv_lens: list[int], q_lens: list[int], *, causal: bool, page_size: int,
    device: torch.device,
) -> Fa3Call:
    has_keys = [n > 0 for n, q in zip(kv_lens, q_lens, strict=True) for _ in range(q)]
    return Fa3Call(
        page_table=table,
        cache_seqlens=_int32(kv_lens, device),
        cu_seqlens_q=_int32(indptr_from_lengths(q_lens), device),
        max_seqlen_q=max(q_lens, default=0),
        causal=causal,
        page_size=page_size,
        has_keys=torch.tensor(has_keys, dtype=torch.bool).to(device),
    )


def build_extend_metadata(
    fb: ForwardBatch, page_size: int, buffer: PageTableBuffer
) -> Fa3Metadata:
    device = fb.req_to_token.device
    seq_lens = list(fb.seq_lens_cpu)
    prefix_lens = list(fb.extend_prefix_lens_cpu)
    ext_lens = list(fb.extend_seq_lens_cpu)
    for i, (seq, prefix, ext) in enumerate(zip(seq_lens, prefix_lens, ext_lens, strict=True)):
        if prefix + ext != seq:
            raise ValueError(f"extend batch is inconsistent for request {i}: prefix {prefix} "
                             f"+ new {ext} tokens != seq_len {seq}")
    buffer.fit_rows(fb.req_to_token.shape[1], page_size)
    rows = fb.req_pool_indices
    if fb.custom_mask is None:
        table = buffer.table(row_page_lists(fb.req_to_token, rows, seq_lens, page_size))
        main = _call(table, seq_lens, ext_lens, causal=True, page_size=page_size,
                     device=device)
        return Fa3Metadata(False, main, table_generation=buffer.generation)
    table = buffer.table(row_page_lists(fb.req_to_token, rows, prefix_lens, page_size))
    main = _call(table, prefix_lens, ext_lens, causal=False, page_size=page_size,
                 device=device)
    blocks = _verify_blocks(fb)
    return Fa3Metadata(False, main, tree=_tree_call(blocks), verify=blocks,
                       table_generation=buffer.generation)


@dataclass(eq=False)
class VerifyBlocks:
    """A tree verify's mask per request, `[ext, prefix + ext]`, with what a per-token call
    needs: the request row's slots for those columns and the new tokens' positions."""

    masks: list[torch.Tensor]
    slots: list[torch.Tensor]
    positions: list[torch.Tensor]
    prefix_lens_cpu: list[int]


def _verify_blocks(fb: ForwardBatch) -> VerifyBlocks:
    assert fb.custom_mask is not None
    device = fb.req_to_token.device
    seq_lens = list(fb.seq_lens_cpu)
    prefix_lens = list(fb.extend_prefix_lens_cpu)
    ext_lens = list(fb.extend_seq_lens_cpu)
    expected = sum(e * s for e, s in zip(ext_lens, seq_lens, strict=True))
    mask = fb.custom_mask.reshape(-1).to(device=device, dtype=torch.bool)
    if mask.numel() != expected:
        raise ValueError(f"custom_mask has {mask.numel()} entries but the batch needs "
                         f"{expected} (sum over requests of new tokens x seq_len)")
    blocks = VerifyBlocks([], [], [], prefix_lens)
    mask_start = query_start = 0
    for i, (seq, ext) in enumerate(zip(seq_lens, ext_lens, strict=True)):
        blocks.masks.append(mask[mask_start : mask_start + ext * seq].view(ext, seq))
        blocks.slots.append(fb.req_to_token[fb.req_pool_indices[i], :seq].to(torch.int64))
        blocks.positions.append(fb.positions[query_start : query_start + ext].to(torch.int64))
        mask_start += ext * seq
        query_start += ext
    return blocks


def _tree_call(blocks: VerifyBlocks) -> Fa3Call:
    """Each new token as its own entry over the tree tokens its mask row allows. The mask
    must show every token the whole prefix (the other call of the verify reads it)."""
    prefix_ok = [m[:, :p].all() for m, p in zip(blocks.masks, blocks.prefix_lens_cpu,
                                                  strict=True)]
    hidden = torch.stack([~ok for ok in prefix_ok]).cpu().tolist() if prefix_ok else []
    bad = [i for i, h in enumerate(hidden) if h]
    if bad:
        raise ValueError(f"verify requests {bad}: the tree mask hides part of the cached "
                         "prefix; attention backend 'fa3' needs every draft token to see the "
                         "whole prefix")
    allowed = [m[:, p:] for m, p in zip(blocks.masks, blocks.prefix_lens_cpu, strict=True)]
    slots = [s[p:] for s, p in zip(blocks.slots, blocks.prefix_lens_cpu, strict=True)]
    return slot_list_call(allowed, slots)


def windowed_verify_call(blocks: VerifyBlocks, window: int) -> Fa3Call:
    """A tree verify on a layer with sliding window `window`, as one call: each new token
    over the keys its mask row allows within the window, by slots. The window counts token
    positions (a node at depth d sits at `prefix + d`), not rows, which FA3's own
    `window_size` cannot express for a tree."""
    allowed = []
    for m, p, q_pos in zip(blocks.masks, blocks.prefix_lens_cpu, blocks.positions, strict=True):
        allowed.append(m & window_mask_by_position(p, q_pos, window))
    return slot_list_call(allowed, blocks.slots)


def slot_list_call(allowed: list[torch.Tensor], slots: list[torch.Tensor]) -> Fa3Call:
    """One entry per query row of each `allowed` `[queries, keys]` block, reading the slots
    of its allowed keys in order through a page-size-1 view of the pool."""
    device = slots[0].device if slots else torch.device("cpu")
    counts = torch.cat([a.sum(dim=1) for a in allowed]) if allowed else torch.zeros(0)
    counts_cpu = [int(c) for c in counts.cpu().tolist()]  # one host sync per call built
    table = torch.zeros(len(counts_cpu), max(max(counts_cpu, default=0), 1), dtype=torch.int32,
                        device=device)
    first_query = 0
    for block, slot in zip(allowed, slots, strict=True):
        query, key = torch.nonzero(block, as_tuple=True)
        column = torch.cumsum(block.to(torch.int64), dim=1)[query, key] - 1
        table[first_query + query, column] = slot[key].to(torch.int32)
        first_query += block.shape[0]
    return _call(table, counts_cpu, [1] * len(counts_cpu), causal=False, page_size=1,
                 device=device)


def build_decode_metadata(
    fb: ForwardBatch, page_size: int, buffer: PageTableBuffer, *, distinct_pages: bool = False
) -> Fa3Metadata:
    """One entry per query. `distinct_pages` is the reverted branch fill (a fix toggle)."""
    device = fb.req_to_token.device
    buffer.fit_rows(fb.req_to_token.shape[1], page_size)
    fill = distinct_page_lists if distinct_pages else kv_list_page_lists
    entries = decode_page_lists(fb, page_size, list_pager=fill)  # branch lists or rows
    table = buffer.table(entries)
    main = _call(table, entries.kv_lens_cpu, [1] * len(entries.kv_lens_cpu), causal=True,
                 page_size=page_size, device=device)
    return Fa3Metadata(True, main, table_generation=buffer.generation)
