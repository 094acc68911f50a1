"""Plain-torch attention over `TritonAttnMetadata`: the oracle the kernels are tested against.

It reads exactly the tables the kernels read (segments, KV lists, first query positions,
custom mask) and applies the same rules as the core's torch_native backend: query r of a
segment sits at `first_query_pos + r`; without a custom mask it sees keys at positions
<= its own; a sliding window of w keeps keys at positions > query position - w (token
positions: a tree node sits at prefix + depth). It is slow
(a loop over segments) and meant for tests and debugging, e.g. of topk>1 draft decode, which
torch_native does not cover.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve_attention_triton.metadata import TritonAttnMetadata, indptr_from_lengths


def segment_mask(
    meta: TritonAttnMetadata, segment: int, sliding_window: int | None
) -> torch.Tensor:
    """Bool `[num_queries, kv_len]` mask (True = may attend) of one segment."""
    device = meta.kv_indices.device
    num_q = meta.queries_per_segment_cpu[segment]
    kv_len = meta.kv_lens_cpu[segment]
    q_pos = meta.first_query_pos_cpu[segment] + torch.arange(num_q, device=device)
    k_pos = torch.arange(kv_len, device=device)
    if meta.custom_mask is not None:
        assert meta.mask_indptr is not None
        start = int(meta.mask_indptr[segment])
        mask = meta.custom_mask[start : start + num_q * kv_len].view(num_q, kv_len) != 0
        if sliding_window is not None and meta.query_positions is not None:
            # A tree's nodes sit at prefix + depth: the window counts token positions.
            begin = sum(meta.queries_per_segment_cpu[:segment])
            q_pos = meta.query_positions[begin : begin + num_q].to(torch.int64)
            prefix = meta.first_query_pos_cpu[segment]
            k_pos = torch.cat([torch.arange(prefix, device=device), q_pos])
    else:
        mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    return mask


def reference_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: TritonAttnMetadata,
    *,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q `[num_queries, heads, head_dim]`, buffers `[slots, kv_heads, head_dim]` -> like q."""
    out = torch.empty_like(q)
    kv_indptr = indptr_from_lengths(meta.kv_lens_cpu)
    qo_indptr = indptr_from_lengths(meta.queries_per_segment_cpu)
    gqa = q.shape[1] != k_buffer.shape[1]
    for s in range(meta.num_segments):
        q_lo, q_hi = qo_indptr[s], qo_indptr[s + 1]
        if q_hi == q_lo:
            continue
        slots = meta.kv_indices[kv_indptr[s] : kv_indptr[s + 1]]
        qs = q[q_lo:q_hi].transpose(0, 1).float()  # [H, Q, D]
        ks = k_buffer[slots].transpose(0, 1).float()  # [KVH, S, D]
        vs = v_buffer[slots].transpose(0, 1).float()
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
            attn_mask=segment_mask(meta, s, sliding_window), scale=scaling, enable_gqa=gqa,
        )
        out[q_lo:q_hi] = o[0].transpose(0, 1).to(q.dtype)
    return out
