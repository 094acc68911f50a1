"""Per-batch FlashInfer metadata, built once per batch in plain torch (no CUDA needed).

Exactly what the wrappers' `plan` takes (int32 tensors). The offsets and last-page lengths
stay on the host, where they are built and where `plan` reads them (FlashInfer copies device
ones back to the host every batch); the page ids are on the device:

- `qo_indptr` `[n + 1]` host (prefill only): entry i's q rows are `qo_indptr[i]:qo_indptr[i+1]`;
- `kv_indptr` `[n + 1]` host: entry i's pages are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`;
- `kv_indices` device: page ids (slot // page_size), a view of the persistent buffer;
- `kv_last_page_len` `[n]` host: tokens on each entry's last page, 1..page_size;
- `custom_mask` (prefill only, optional): bool, per entry `[qo_len, kv_len]` row-major,
  concatenated; the same layout as `ForwardBatch.custom_mask`. None = causal, aligned to
  the end of the KV (query r of an entry with `qo_len` queries sits at `kv_len - qo_len + r`).
  A windowed layer of a tree verify plans with the mask and its window folded together
  (`mask_for_window`): a tree's window counts token positions (a node at depth d sits at
  `prefix + d`, whatever its row), which FlashInfer's `window_left` (counting rows) cannot
  say, so it plans with `window_left = -1` and `plugserve.attention.paging`'s
  `fold_window_into_mask`.

Entries: extend modes (EXTEND, TARGET_VERIFY, DRAFT_EXTEND) have one per request, reading
`req_to_token[row, :seq_len]`; a decode has one per query: a request's row, or in a topk>1
draft decode one per branch, from the per-branch KV lists in `forward_batch.extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugserve.attention.paging import (
    PageLists,
    decode_page_lists,
    fold_window_into_mask,
    indptr_from_lengths,
    row_page_lists,
)
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_attention_flashinfer.buffers import PageIndexBuffer


@dataclass(eq=False)
class FlashInferMetadata:
    is_decode: bool
    page_size: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens_cpu: list[int]
    qo_lens_cpu: list[int]
    qo_indptr: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    buffer_generation: int = 0  # the index buffer's write that holds kv_indices
    # A verify's windowed layers fold their window into the mask (by position): the new
    # tokens' positions and the prefix lengths, and the folded masks built so far per window.
    positions: torch.Tensor | None = None
    prefix_lens_cpu: list[int] = field(default_factory=list)
    windowed_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for_window(self, window: int | None) -> torch.Tensor | None:
        """The custom mask a layer with sliding window `window` plans with."""
        if self.custom_mask is None or window is None:
            return self.custom_mask
        if window not in self.windowed_masks:
            assert self.positions is not None
            self.windowed_masks[window] = fold_window_into_mask(
                self.custom_mask, self.positions, self.prefix_lens_cpu, self.qo_lens_cpu, window)
        return self.windowed_masks[window]

    @property
    def num_entries(self) -> int:
        return len(self.kv_lens_cpu)


def _host_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _paged(
    pages: PageLists, buffer: PageIndexBuffer, qo_lens: list[int], *, is_decode: bool,
    device: torch.device,
) -> FlashInferMetadata:
    kv_indices = buffer.write(pages.page_ids, len(pages.kv_lens_cpu))
    return FlashInferMetadata(
        is_decode=is_decode,
        page_size=pages.page_size,
        kv_indptr=_host_int32(pages.page_indptr_cpu),
        kv_indices=kv_indices,
        kv_last_page_len=_host_int32(pages.last_page_lens_cpu),
        kv_lens_cpu=list(pages.kv_lens_cpu),
        qo_lens_cpu=list(qo_lens),
        qo_indptr=None if is_decode else _host_int32(indptr_from_lengths(qo_lens)),
        buffer_generation=buffer.generation,
    )


def build_extend_metadata(
    fb: ForwardBatch, page_size: int, buffer: PageIndexBuffer
) -> FlashInferMetadata:
    """One prefill entry per request: its new tokens over `req_to_token[row, :seq_len]`."""
    seq_lens = list(fb.seq_lens_cpu)
    ext_lens = list(fb.extend_seq_lens_cpu)
    for i, (seq, prefix, ext) in enumerate(
        zip(seq_lens, fb.extend_prefix_lens_cpu, ext_lens, strict=True)
    ):
        if prefix + ext != seq:
            raise ValueError(f"extend batch is inconsistent for request {i}: prefix {prefix} "
                             f"+ new {ext} tokens != seq_len {seq}")
    buffer.fit_rows(fb.req_to_token.shape[1], page_size)
    pages = row_page_lists(fb.req_to_token, fb.req_pool_indices, seq_lens, page_size)
    meta = _paged(pages, buffer, ext_lens, is_decode=False, device=fb.req_to_token.device)
    if fb.custom_mask is not None:
        expected = sum(e * s for e, s in zip(ext_lens, seq_lens, strict=True))
        if fb.custom_mask.numel() != expected:
            raise ValueError(
                f"custom_mask has {fb.custom_mask.numel()} entries but the batch needs "
                f"{expected} (sum over requests of new tokens x seq_len)"
            )
        meta.custom_mask = fb.custom_mask.reshape(-1).to(torch.bool)
        meta.positions = fb.positions
        meta.prefix_lens_cpu = list(fb.extend_prefix_lens_cpu)
    return meta


def build_decode_metadata(
    fb: ForwardBatch, page_size: int, buffer: PageIndexBuffer
) -> FlashInferMetadata:
    """One decode entry per query: a request's row, or a branch's KV list (topk>1)."""
    device = fb.req_to_token.device
    buffer.fit_rows(fb.req_to_token.shape[1], page_size)
    pages = decode_page_lists(fb, page_size)  # branch lists or request rows
    return _paged(pages, buffer, [1] * len(pages.kv_lens_cpu), is_decode=True, device=device)
