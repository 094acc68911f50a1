"""Decode attention over the paged KV cache: the compiled CPU kernel and its reference.

Query row `i` attends to the keys at `slots[i, first_key[i]:kv_lens[i]]` of the layer's K and
V buffers ([slots, kv_heads, head_dim]); `first_key` is 0 for a full layer and
`kv_lens - window` for a sliding-window one. `reference` does this with a gathered,
padded copy and `scaled_dot_product_attention` in float32 (what `torch_native` did before the
kernel); `paged_decode` runs `csrc/kernels/paged_decode.cpp`, which reads each key and value
where it lies, once, and computes in float32 as well (bf16 keys under bf16 queries are
dotted as bf16 pairs where the CPU has AVX-512 BF16: exact products, float32 sums). Its work
is cut into one piece of keys per thread, so a long row is split between the threads and
its parts merged. The cache may hold the queries' dtype, bf16 (under float32 queries) or fp8
(e4m3 / e5m2), widened as it is read. The kernel is tested against the reference
(tests/kernels/test_paged_decode_kernel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugserve.kernels import build


@dataclass(frozen=True)
class PagedDecodePlan:
    """One layer's decode attention as plain operands of the CPU paged-decode kernel
    (`plugserve.kernels.paged_decode`): the new k/v rows go to rows `store_slots` of
    `k_buffer` / `v_buffer` ([slots, kv_heads, head_dim]), then query row i attends to the keys
    at `slots[i, first_key[i]:kv_lens[i]]` (int64) with softmax scale `scale`."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    store_slots: torch.Tensor
    slots: torch.Tensor
    first_key: torch.Tensor
    kv_lens: torch.Tensor
    scale: float


def available() -> bool:
    """True when the compiled kernel loads on this machine (compiling it the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def paged_decode(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
    first_key: torch.Tensor, kv_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [queries, heads, head_dim] -> [queries, heads, head_dim] in q's dtype."""
    out: torch.Tensor = build.ops().paged_decode(q, k_buf, v_buf, slots, first_key, kv_lens, scale)
    return out


def reference(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
    first_key: torch.Tensor, kv_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    queries, width = slots.shape
    heads, kv_heads = q.shape[1], k_buf.shape[1]
    key_pos = torch.arange(width, device=q.device)
    valid = (key_pos[None, :] < kv_lens[:, None]) & (key_pos[None, :] >= first_key[:, None])
    safe = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
    k = k_buf.index_select(0, safe).view(queries, width, kv_heads, -1).float()
    v = v_buf.index_select(0, safe).view(queries, width, kv_heads, -1).float()
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=heads != kv_heads,
    )
    return out.squeeze(2).to(q.dtype)
