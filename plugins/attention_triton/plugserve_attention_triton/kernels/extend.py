"""Extend attention: each request's new tokens over its paged KV (cached prefix + themselves).

One program handles `BLOCK_M` queries of one segment (request) for one query head. It walks
the segment's KV list in tiles of `BLOCK_N` slots, loading K and V through `kv_indices`, so
any page size and any slot order work. Visibility of key position k to the query at position
p (p = first_query_pos + row):

- without a custom mask: causal, k <= p; with one: the mask's (row, k) entry;
- with a sliding window w and no mask: also k > p - w (with a mask the caller folds the window
  into it by token position: a tree node is not at first_query_pos + row).

The tile loop is bounded to the keys that can be visible, and the softmax is the usual
running-maximum form in base 2. Both products run on the tensor cores in the input dtype
with fp32 accumulation: Q.K^T on the loaded tiles, P.V with the probabilities rounded to
the input dtype (as every flash-attention kernel does); the softmax statistics and the
output accumulator stay fp32. fp32 inputs multiply in full fp32 (`input_precision="ieee"`):
tf32 would round every operand to 10 mantissa bits, far outside fp32's tolerance.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plugserve_attention_triton.kernels.launch import KernelLaunch, kernel_arch
from plugserve_attention_triton.kernels.tiles import (
    LOG2_E,
    MIN_DOT_DIM,
    dot_in_fp32,
    extend_tiles,
    pow2_at_least,
)
from plugserve_attention_triton.metadata import TritonAttnMetadata, window_folded_mask


@functools.partial(
    triton.jit,
    # Neither value changes the code worth a kernel of its own: specialising on them (a
    # ratio of 1, a window divisible by 16) would only multiply the variants to compile.
    do_not_specialize=["sliding_window", "heads_per_kv_head"],
)
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    first_query_pos_ptr,
    mask_ptr,
    mask_indptr_ptr,
    qk_scale_log2,
    sliding_window,
    heads_per_kv_head,
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)

    # Offsets within a segment are int32 (a segment's queries, keys and mask block are far
    # below 2**31); bases into the batch and KV slots are int64. Fewer 64-bit tiles, fewer
    # registers.
    q_begin = tl.load(qo_indptr_ptr + segment).to(tl.int64)
    num_queries = (tl.load(qo_indptr_ptr + segment + 1) - q_begin).to(tl.int32)
    row_begin = block_m * BLOCK_M
    if row_begin >= num_queries:
        return
    kv_begin = tl.load(kv_indptr_ptr + segment).to(tl.int64)
    kv_len = (tl.load(kv_indptr_ptr + segment + 1) - kv_begin).to(tl.int32)
    first_pos = tl.load(first_query_pos_ptr + segment).to(tl.int32)
    kv_head = head // heads_per_kv_head
    segment_slots = kv_indices_ptr + kv_begin
    k_head = k_ptr + kv_head * stride_k_head
    v_head = v_ptr + kv_head * stride_v_head

    rows = row_begin + tl.arange(0, BLOCK_M)
    row_valid = rows < num_queries
    q_pos = first_pos + rows
    token_rows = (q_begin + rows.to(tl.int64))[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_offsets = token_rows * stride_q_token + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys that can be visible to this block's queries.
    last_row = tl.minimum(row_begin + BLOCK_M, num_queries) - 1
    key_end = kv_len
    if not HAS_MASK:
        key_end = tl.minimum(kv_len, first_pos + last_row + 1)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(0, first_pos + row_begin - sliding_window + 1)
    segment_mask = mask_ptr
    if HAS_MASK:
        segment_mask = mask_ptr + tl.load(mask_indptr_ptr + segment).to(tl.int64)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_begin in range(key_begin, key_end, BLOCK_N):
        keys = tile_begin + tl.arange(0, BLOCK_N)
        key_valid = keys < key_end
        slots = tl.load(segment_slots + keys, mask=key_valid, other=0).to(tl.int64)
        k_offsets = slots[:, None] * stride_k_slot + offs_d[None, :]
        k = tl.load(k_head + k_offsets, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2

        visible = row_valid[:, None] & key_valid[None, :]
        if HAS_MASK:
            allowed = tl.load(segment_mask + rows[:, None] * kv_len + keys[None, :],
                              mask=visible, other=0)
            visible = visible & (allowed != 0)
        else:
            visible = visible & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(running_max - safe_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)

        v_offsets = slots[:, None] * stride_v_slot + offs_d[None, :]
        v = tl.load(v_head + v_offsets, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        # P in V's dtype for the tensor cores; the interpreter's dot needs fp32 for bf16, so
        # there P is rounded to V's dtype first and then multiplied exactly in fp32.
        p = probs.to(v.dtype)
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * rescale[:, None], input_precision="ieee")
        running_max = new_max

    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    o_offsets = token_rows * stride_o_token + head * stride_o_head + offs_d[None, :]
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])


def extend_launch(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    meta: TritonAttnMetadata,
    *,
    scaling: float,
    sliding_window: int | None,
    arch: int | None,
) -> KernelLaunch:
    """The launch that writes extend attention of q into `out` (q's shape), for compute
    capability `arch` (None: the CPU interpreter)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    block_d = pow2_at_least(head_dim, MIN_DOT_DIM)
    tiles = extend_tiles(arch, q.dtype, block_d)
    grid = (meta.num_segments, num_heads, triton.cdiv(meta.max_queries_per_segment,
                                                      tiles.block_m))
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask if meta.custom_mask is not None else meta.kv_indices
    if has_mask and sliding_window is not None:
        # A tree's nodes are not at first_query_pos + row: the window goes into the mask,
        # by position, and the kernel's own (row-based) window test is off.
        mask = window_folded_mask(meta, sliding_window)
        sliding_window = None
    mask_indptr = meta.mask_indptr if meta.mask_indptr is not None else meta.kv_indptr
    args = (
        q, k_buffer, v_buffer, out,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.first_query_pos,
        mask, mask_indptr,
        scaling * LOG2_E,
        sliding_window or 0,
        num_heads // num_kv_heads,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
    )
    options: dict[str, object] = dict(
        HEAD_DIM=head_dim,
        HAS_MASK=has_mask,
        HAS_WINDOW=sliding_window is not None,
        DOT_IN_FP32=dot_in_fp32(arch, q.dtype),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        **tiles.launch_options(),
    )
    return KernelLaunch(_extend_kernel, grid, args, options)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: TritonAttnMetadata,
    *,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q `[tokens, heads, head_dim]` and buffers `[slots, kv_heads, head_dim]` -> like q."""
    out = torch.empty_like(q)
    if q.shape[0] == 0 or meta.num_segments == 0:
        return out
    extend_launch(q, k_buffer, v_buffer, out, meta, scaling=scaling,
                  sliding_window=sliding_window, arch=kernel_arch(_extend_kernel, q.device)).run()
    return out
