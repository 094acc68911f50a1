"""A CPU interpreter of FA3's `flash_attn_with_kvcache`: the oracle the metadata is tested with.

`flash_attn_with_kvcache` here takes the keyword arguments the backend gives FA3's and
computes attention the way FlashAttention documents it, from those tensors alone:

- paged KV: `k_cache`/`v_cache` are `[num_blocks, page_block_size, kv_heads, head_dim]`;
  batch entry b reads token j (`j < cache_seqlens[b]`) from block `page_table[b, j // page]`
  at offset `j % page`;
- q is varlen `[total_q, heads, head_dim]` with `cu_seqlens_q` (entry b's rows are
  `cu_seqlens_q[b]:cu_seqlens_q[b+1]`) and `max_seqlen_q`, or batched `[batch, seqlen, ...]`;
- `causal` aligns query i of `seqlen_q` to the bottom right: keys `j <= i + seqlen_k -
  seqlen_q`; `window_size=(left, right)` keeps keys in `[i + seqlen_k - seqlen_q - left,
  i + seqlen_k - seqlen_q + right]`, -1 meaning unbounded (causal forces right = 0);
- `softmax_scale` defaults to `1/sqrt(head_dim)`; grouped-query heads share KV heads in order;
- a query with no key gets output 0; with `return_softmax_lse` the natural-log LSE comes back
  `[heads, total_q]` (varlen) or `[batch, heads, seqlen]`, +inf for a query with no key (a
  caller must not merge such a row by its LSE).

Arguments a real kernel would read out of bounds are refused with a ValueError; features the
backend never uses (appending k/v, rotary, cache_batch_idx, leftpad) are refused too. Math in
float32; the output has q's dtype. Slow (a loop over entries): for tests only.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import torch


def _host(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (FA3's index type), got {t.dtype}")
    return [int(v) for v in t.cpu().reshape(-1).tolist()]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_softmax_lse: bool = False,
    **unsupported: Any,
) -> Any:
    refused = sorted(name for name, value in unsupported.items() if value is not None)
    if k is not None or v is not None:
        refused.append("k/v (appending to the cache)")
    if refused:
        raise ValueError(f"the interpreter does not implement {', '.join(refused)}")
    varlen = cu_seqlens_q is not None
    lens = _host(cache_seqlens, "cache_seqlens")
    table = page_table.cpu()
    if page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise ValueError(f"page_table must be int32 [batch, max_pages], got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if table.shape[0] != len(lens):
        raise ValueError(f"page_table has {table.shape[0]} rows for {len(lens)} cache_seqlens")
    blocks, page = k_cache.shape[0], k_cache.shape[1]
    if varlen:
        assert cu_seqlens_q is not None
        cu = _host(cu_seqlens_q, "cu_seqlens_q")
        if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens_q {cu} does not fit {len(lens)} entries and "
                             f"{q.shape[0]} q rows")
        if max_seqlen_q is None or max_seqlen_q < max(b - a for a, b in pairwise(cu)):
            raise ValueError(f"max_seqlen_q {max_seqlen_q} is below a query length")
        q_rows = q
    else:
        cu = [b * q.shape[1] for b in range(q.shape[0] + 1)]
        q_rows = q.reshape(-1, *q.shape[2:])
    heads, kv_heads, dim = q.shape[-2], k_cache.shape[2], q.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros_like(q_rows)
    lse = torch.full((heads, q_rows.shape[0]), float("inf"), dtype=torch.float32,
                     device=q.device)
    for b, kv_len in enumerate(lens):
        lo, hi = cu[b], cu[b + 1]
        n_pages = -(-kv_len // page)
        if n_pages > table.shape[1]:
            raise ValueError(f"entry {b}: {kv_len} tokens need {n_pages} pages; page_table "
                             f"has {table.shape[1]} columns")
        pages = table[b, :n_pages].tolist()
        if any(not 0 <= p < blocks for p in pages):
            raise ValueError(f"entry {b}: page ids {pages} outside the cache's {blocks} blocks")
        if hi == lo or kv_len == 0:
            continue
        index = torch.tensor(pages, dtype=torch.int64, device=k_cache.device)
        keys = k_cache.index_select(0, index).flatten(0, 1)[:kv_len].float()
        vals = v_cache.index_select(0, index).flatten(0, 1)[:kv_len].float()
        group = heads // kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv, D]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(hi - lo, device=q.device) + kv_len - (hi - lo)
        k_pos = torch.arange(kv_len, device=q.device)
        allowed = torch.ones(hi - lo, kv_len, dtype=torch.bool, device=q.device)
        if left >= 0:
            allowed &= k_pos[None, :] >= q_pos[:, None] - left
        if right >= 0:
            allowed &= k_pos[None, :] <= q_pos[:, None] + right
        scores = torch.matmul(q_rows[lo:hi].float().transpose(0, 1), keys.transpose(1, 2))
        scores = (scores * scale).masked_fill(~allowed[None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, q]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[lo:hi] = torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)
        lse[:, lo:hi] = torch.where(torch.isfinite(row_lse), row_lse,
                                    torch.full_like(row_lse, float("inf")))
    result = out if varlen else out.view_as(q)
    if not return_softmax_lse:
        return result
    if not varlen:
        lse = lse.view(heads, q.shape[0], q.shape[1]).permute(1, 0, 2)
    return result, lse
