"""topk>1 draft decode: one KV list per branch. This is the contract with spec plugins.

In `DRAFT_DECODE` mode with `topk` branches per request, q has `batch * topk` rows in
request-major order: row `i * topk + t` is branch `t` of request `i`. Each row reads its own
KV list: the request's committed prefix, then its branch's draft path up to and including the
token this step writes. Before `init_forward_metadata`, the spec plugin puts in
`forward_batch.extra`:

- `"draft_kv_indptr"`: int64 `[batch * topk + 1]`, on the model's device;
- `"draft_kv_indices"`: int64 KV slots, list after list, each in position order;
- `"draft_kv_lens_cpu"`: `list[int]`, each list's length (host mirror: the backend sizes its
  grids from it without reading device memory).

`DraftKVLists.store(fb)` writes the three keys. `build_draft_kv_lists` builds them from
`req_to_token` and the row positions of each branch's path; `holey_branch_positions` gives
those positions for the layout of DESIGN.md §5 (`plugserve.structs.holey_layout.HoleyLayout`: each
branch owns whole pages after the prefix's page-aligned base; with page_size 1 branches simply
follow one another), so a spec plugin that drafts each branch into its own slots needs nothing
else. A plugin that tracks true ancestor paths (a branch re-parented after re-ranking) passes
those positions instead.

When the three keys are present they win, for any topk (topk 1 too). Without them a decode
batch must have one query per request and reads `req_to_token[row, :seq_len]`. Backends size
their buffers from `draft_kv_lens_cpu` (so with the topk factor) and read `draft_kv_indices`;
the device `draft_kv_indptr` is there for backends that take an indptr as it is.
"""

from __future__ import annotations

import torch

from plugserve.attention.paging.kv_lists import (
    DRAFT_KV_INDICES,
    DRAFT_KV_INDPTR,
    DRAFT_KV_KEYS,
    DRAFT_KV_LENS_CPU,
    DraftKVLists,
)
from plugserve.attention.paging.pages import indptr_from_lengths
from plugserve.structs.holey_layout import HoleyLayout

__all__ = [
    "DRAFT_KV_INDICES",
    "DRAFT_KV_INDPTR",
    "DRAFT_KV_KEYS",
    "DRAFT_KV_LENS_CPU",
    "DraftKVLists",
    "build_draft_kv_lists",
    "holey_branch_positions",
    "indptr_from_lengths",
]


def holey_branch_positions(
    prefix_lens_cpu: list[int], *, topk: int, step: int, num_steps: int, page_size: int
) -> torch.Tensor:
    """Row positions `[batch, topk, step + 1]` of each branch's draft tokens 0..step.

    Draft step `s` is 0-based, as in `HoleyLayout`: with `last = prefix % page` and
    `base = prefix - last`, draft step s of branch t sits at `base + t*stride + last + s`
    (`stride = HoleyLayout.stride`). With page_size 1 this is `prefix + t*num_steps + s`.
    Branch 0 continues the prefix contiguously.
    """
    return HoleyLayout(page_size, num_steps, topk).path_positions(prefix_lens_cpu, step)


def build_draft_kv_lists(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens_cpu: list[int],
    path_positions: torch.Tensor,
) -> DraftKVLists:
    """Per-branch KV lists: `row[:prefix]` then `row[path_positions[i, t]]`, request-major.

    `path_positions` is int64 `[batch, topk, path_len]`: the row positions of each branch's
    draft tokens from the first draft step to the current one.
    """
    device = req_to_token.device
    batch, topk, path_len = path_positions.shape
    if path_len < 1:
        raise ValueError("each branch path needs at least the token this step writes")
    if batch != len(prefix_lens_cpu):
        raise ValueError(
            f"path_positions covers {batch} requests but prefix_lens_cpu has "
            f"{len(prefix_lens_cpu)}"
        )
    lens_cpu = [p + path_len for p in prefix_lens_cpu for _ in range(topk)]
    indptr_cpu = indptr_from_lengths(lens_cpu)
    total = indptr_cpu[-1]
    num_queries = batch * topk
    lens = torch.tensor(lens_cpu, dtype=torch.int64).to(device)
    starts = torch.tensor(indptr_cpu[:-1], dtype=torch.int64).to(device)
    prefix = torch.tensor(prefix_lens_cpu, dtype=torch.int64).to(device).repeat_interleave(topk)
    query = torch.repeat_interleave(
        torch.arange(num_queries, device=device), lens, output_size=total
    )
    pos_in_list = torch.arange(total, device=device) - starts[query]
    paths = path_positions.to(device=device, dtype=torch.int64).reshape(num_queries, path_len)
    in_path = pos_in_list >= prefix[query]
    path_step = torch.where(in_path, pos_in_list - prefix[query], torch.zeros_like(pos_in_list))
    row_pos = torch.where(in_path, paths[query, path_step], pos_in_list)
    rows = req_pool_indices.to(device).repeat_interleave(topk)
    indices = req_to_token[rows[query], row_pos].to(torch.int64)
    return DraftKVLists(torch.tensor(indptr_cpu, dtype=torch.int64, device=device), indices,
                        lens_cpu)
