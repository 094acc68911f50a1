"""Per-batch index tables the Triton kernels read, built once per batch in plain torch.

Everything is phrased in *segments*: a segment is a run of query rows that read one KV list.

- extend modes (EXTEND, TARGET_VERIFY, DRAFT_EXTEND): one segment per request; its queries
  are the request's new tokens and its KV list is `req_to_token[row, :seq_len]`.
- decode modes (DECODE, DRAFT_DECODE): one segment per query. A normal decode has one query
  per request. A topk>1 draft decode has `topk` queries per request, each with its own KV
  list (prefix + that branch's path), given by the spec plugin (see `draft_kv`).

Tables (device tensors, int64 unless noted):

- `qo_indptr[s] .. qo_indptr[s+1]`: the q rows of segment s.
- `kv_indptr[s] .. kv_indptr[s+1]`: the range of `kv_indices` holding segment s's KV slots, in
  position order (entry j is the token at position j).
- `first_query_pos[s]`: position of segment s's first query in its KV list (extend: the
  cached prefix length; decode: the list length minus one). Query r of the segment sits at
  `first_query_pos[s] + r`; causal and sliding-window masks are relative to that.
- `mask_indptr[s]`: where segment s's `[num_queries, kv_len]` row-major block starts in
  `custom_mask` (uint8 view of the batch's bool mask); None without a custom mask.
- `num_kv_splits[s]` (int32, decode only): how many chunks the decode kernel splits segment
  s's KV into; `max_kv_splits` sizes the partial-result buffers.

Host mirrors (`*_cpu` lists) are kept for the reference implementation and for sizing
launch grids without reading device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugserve.attention.paging import (
    fold_window_into_mask,
    gather_row_slots,
    indptr_from_lengths,
    kv_list_lengths,
)
from plugserve.structs.forward_batch import ForwardBatch

__all__ = ["TritonAttnMetadata", "build_decode_metadata", "build_extend_metadata",
           "gather_row_slots", "indptr_from_lengths", "kv_split_counts", "window_folded_mask"]


@dataclass
class TritonAttnMetadata:
    is_decode: bool
    num_queries: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    first_query_pos: torch.Tensor
    queries_per_segment_cpu: list[int]
    kv_lens_cpu: list[int]
    first_query_pos_cpu: list[int]
    mask_indptr: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    num_kv_splits: torch.Tensor | None = None
    max_kv_splits: int = 1
    # A hybrid SWA pool: the same tables with `kv_indices` translated to the windowed layers'
    # slots (built once per batch by the backend); None when no layer is windowed.
    windowed: TritonAttnMetadata | None = None
    # With a custom mask: every new token's position (a tree node sits at prefix + depth,
    # not prefix + its index), to fold a sliding window into the mask by position.
    query_positions: torch.Tensor | None = None
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # Decode partial results, allocated on first use and shared by every layer of the batch.
    _scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @property
    def num_segments(self) -> int:
        return len(self.kv_lens_cpu)

    @property
    def max_queries_per_segment(self) -> int:
        return max(self.queries_per_segment_cpu, default=0)

    def decode_scratch(
        self, num_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 buffers for the split-KV decode: partial outputs and their log-sum-exps."""
        key = (num_heads, head_dim)
        if key not in self._scratch:
            device = self.kv_indices.device
            shape = (self.num_queries, num_heads, self.max_kv_splits)
            partial_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
            partial_lse = torch.empty(shape, dtype=torch.float32, device=device)
            self._scratch[key] = (partial_out, partial_lse)
        return self._scratch[key]


def kv_split_counts(kv_lens: list[int], max_kv_splits: int, min_tokens_per_split: int) -> list[int]:
    """Chunks per KV list: one per `min_tokens_per_split` tokens, at most `max_kv_splits`."""
    per_split = max(1, min_tokens_per_split)
    return [max(1, min(max_kv_splits, -(-n // per_split))) for n in kv_lens]


def _tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def build_extend_metadata(fb: ForwardBatch) -> TritonAttnMetadata:
    """One segment per request: its new tokens over `req_to_token[row, :seq_len]`."""
    device = fb.req_to_token.device
    seq_lens = list(fb.seq_lens_cpu)
    ext_lens = list(fb.extend_seq_lens_cpu)
    prefix_lens = list(fb.extend_prefix_lens_cpu)
    for i, (seq_len, prefix_len, ext_len) in enumerate(
        zip(seq_lens, prefix_lens, ext_lens, strict=True)
    ):
        if prefix_len + ext_len != seq_len:
            raise ValueError(
                f"extend batch is inconsistent for request {i}: prefix {prefix_len} + new "
                f"{ext_len} tokens != seq_len {seq_len}"
            )
    meta = TritonAttnMetadata(
        is_decode=False,
        num_queries=sum(ext_lens),
        qo_indptr=_tensor(indptr_from_lengths(ext_lens), device),
        kv_indptr=_tensor(indptr_from_lengths(seq_lens), device),
        kv_indices=gather_row_slots(fb.req_to_token, fb.req_pool_indices, seq_lens),
        first_query_pos=_tensor(prefix_lens, device),
        queries_per_segment_cpu=ext_lens,
        kv_lens_cpu=seq_lens,
        first_query_pos_cpu=prefix_lens,
    )
    if fb.custom_mask is not None:
        block_sizes = [e * s for e, s in zip(ext_lens, seq_lens, strict=True)]
        expected = sum(block_sizes)
        if fb.custom_mask.numel() != expected:
            raise ValueError(
                f"custom_mask has {fb.custom_mask.numel()} entries but the batch needs "
                f"{expected} (sum over requests of new tokens x seq_len)"
            )
        meta.mask_indptr = _tensor(indptr_from_lengths(block_sizes), device)
        mask = fb.custom_mask.to(device).reshape(-1)
        meta.custom_mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(
            torch.uint8
        )
        meta.query_positions = fb.positions.to(device)
    return meta


def window_folded_mask(meta: TritonAttnMetadata, window: int) -> torch.Tensor:
    """The custom mask with a sliding window folded in by token position: key k of segment s
    is at position k below the prefix and at its new token's position above it. Built once
    per batch and window."""
    cached = meta._window_masks.get(window)
    if cached is not None:
        return cached
    assert meta.custom_mask is not None and meta.query_positions is not None
    folded = fold_window_into_mask(meta.custom_mask, meta.query_positions,
                                   meta.first_query_pos_cpu, meta.queries_per_segment_cpu,
                                   window)
    meta._window_masks[window] = folded.to(torch.uint8)
    return meta._window_masks[window]


def build_decode_metadata(
    *,
    kv_indptr_cpu: list[int],
    kv_indices: torch.Tensor,
    max_kv_splits: int,
    min_tokens_per_split: int,
) -> TritonAttnMetadata:
    """One segment per query, whose KV list is `kv_indices[kv_indptr[q]:kv_indptr[q+1]]`."""
    device = kv_indices.device
    kv_lens = kv_list_lengths(kv_indptr_cpu)
    num_queries = len(kv_lens)
    splits = kv_split_counts(kv_lens, max_kv_splits, min_tokens_per_split)
    first_pos = [n - 1 for n in kv_lens]
    return TritonAttnMetadata(
        is_decode=True,
        num_queries=num_queries,
        qo_indptr=torch.arange(num_queries + 1, dtype=torch.int64, device=device),
        kv_indptr=_tensor(kv_indptr_cpu, device),
        kv_indices=kv_indices.to(device=device, dtype=torch.int64),
        first_query_pos=_tensor(first_pos, device),
        queries_per_segment_cpu=[1] * num_queries,
        kv_lens_cpu=kv_lens,
        first_query_pos_cpu=first_pos,
        num_kv_splits=_tensor(splits, device, torch.int32),
        max_kv_splits=max(splits, default=1),
    )
