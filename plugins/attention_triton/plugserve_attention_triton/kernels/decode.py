"""Decode attention: one query per segment over its paged KV list, split along the KV length.

Stage 1 (`_decode_partial_kernel`): one program per (query, KV head, split). It handles every
query head that shares the KV head at once (grouped-query attention reads each K/V tile once
for the whole group), walks its chunk of the KV list in tiles of `BLOCK_N` slots, and writes
the chunk's normalised output and its log-sum-exp (base 2). With a sliding window w only the
last w keys of the list are split and read. A split past `num_kv_splits[query]` does nothing;
an empty split writes a log-sum-exp of -inf.

Stage 2 (`_decode_reduce_kernel`): one program per (query, head) merges the splits, weighting
each by exp2(lse - max lse).

Works for a normal decode (a list per request) and for topk>1 draft decode (a list per
branch), since both are just per-query KV lists. Both products of stage 1 run on the tensor
cores in the input dtype with fp32 accumulation (P rounded to V's dtype), as in `extend`;
fp32 inputs multiply in full fp32. Partial results, statistics and the merge are fp32.
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
    decode_head_tile,
    decode_tiles,
    dot_in_fp32,
    pow2_at_least,
)
from plugserve_attention_triton.metadata import TritonAttnMetadata

# Values that change no code worth a kernel of its own: the partial log-sum-exp buffer's
# strides follow the batch's largest split count (1 or more), and specialising on them, on
# the window or on the head ratio (1 for MHA) would only multiply the variants to compile.
_LSE_STRIDES = ["stride_pl_query", "stride_pl_head"]


@functools.partial(
    triton.jit,
    do_not_specialize=["sliding_window", "heads_per_kv_head", *_LSE_STRIDES],
)
def _decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_kv_splits_ptr,
    qk_scale_log2,
    sliding_window,
    heads_per_kv_head,
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_po_query,
    stride_po_head,
    stride_po_split,
    stride_pl_query,
    stride_pl_head,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    query = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    num_splits = tl.load(num_kv_splits_ptr + query)
    if split >= num_splits:
        return
    # Positions within a KV list are int32; bases into the batch and the KV slots int64.
    kv_begin = tl.load(kv_indptr_ptr + query).to(tl.int64)
    kv_len = (tl.load(kv_indptr_ptr + query + 1) - kv_begin).to(tl.int32)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(0, kv_len - sliding_window)
    chunk = tl.cdiv(kv_len - first_key, num_splits)
    split_begin = first_key + split * chunk
    split_end = tl.minimum(split_begin + chunk, kv_len)
    list_slots = kv_indices_ptr + kv_begin
    k_head = k_ptr + kv_head * stride_k_head
    v_head = v_ptr + kv_head * stride_v_head

    offs_h = tl.arange(0, BLOCK_H)
    head_valid = offs_h < heads_per_kv_head
    heads = kv_head * heads_per_kv_head + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_offsets = query * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile_begin in range(split_begin, split_end, BLOCK_N):
        keys = tile_begin + tl.arange(0, BLOCK_N)
        key_valid = keys < split_end
        slots = tl.load(list_slots + keys, mask=key_valid, other=0).to(tl.int64)
        k_offsets = slots[:, None] * stride_k_slot + offs_d[None, :]
        k = tl.load(k_head + k_offsets, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2
        scores = tl.where(key_valid[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(running_max - safe_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)

        v_offsets = slots[:, None] * stride_v_slot + offs_d[None, :]
        v = tl.load(v_head + v_offsets, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        p = probs.to(v.dtype)
        if DOT_IN_FP32:  # the interpreter's bf16 dot: round P, then multiply exactly in fp32
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * rescale[:, None], input_precision="ieee")
        running_max = new_max

    has_keys = running_sum > 0.0
    out = acc / tl.where(has_keys, running_sum, 1.0)[:, None]
    lse = tl.where(has_keys, running_max + tl.log2(tl.where(has_keys, running_sum, 1.0)),
                   float("-inf"))
    po_offsets = (query * stride_po_query + heads[:, None] * stride_po_head
                  + split * stride_po_split + offs_d[None, :])
    tl.store(partial_out_ptr + po_offsets, out, mask=head_valid[:, None] & d_valid[None, :])
    pl_offsets = query * stride_pl_query + heads * stride_pl_head + split
    tl.store(partial_lse_ptr + pl_offsets, lse, mask=head_valid)


@functools.partial(triton.jit, do_not_specialize=_LSE_STRIDES)
def _decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    o_ptr,
    num_kv_splits_ptr,
    stride_po_query,
    stride_po_head,
    stride_po_split,
    stride_pl_query,
    stride_pl_head,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    query = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_splits = tl.load(num_kv_splits_ptr + query)

    offs_s = tl.arange(0, BLOCK_S)
    split_valid = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    lse = tl.load(partial_lse_ptr + query * stride_pl_query + head * stride_pl_head + offs_s,
                  mask=split_valid, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.where(split_valid, tl.exp2(lse - top), 0.0)
    po_offsets = (query * stride_po_query + head * stride_po_head
                  + offs_s[:, None] * stride_po_split + offs_d[None, :])
    partial = tl.load(partial_out_ptr + po_offsets,
                      mask=split_valid[:, None] & d_valid[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    o_offsets = query * stride_o_token + head * stride_o_head + offs_d
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=d_valid)


def decode_launches(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    meta: TritonAttnMetadata,
    *,
    scaling: float,
    sliding_window: int | None,
    arch: int | None,
) -> tuple[KernelLaunch, KernelLaunch]:
    """The two launches (partial, reduce) that write decode attention of q into `out`, for
    compute capability `arch` (None: the CPU interpreter)."""
    num_queries, num_heads, head_dim = q.shape
    assert meta.num_kv_splits is not None
    num_kv_heads = k_buffer.shape[1]
    heads_per_kv_head = num_heads // num_kv_heads
    block_d = pow2_at_least(head_dim, MIN_DOT_DIM)
    tiles = decode_tiles(arch, q.dtype, block_d)
    partial_out, partial_lse = meta.decode_scratch(num_heads, head_dim)
    partial = KernelLaunch(
        _decode_partial_kernel,
        (num_queries, num_kv_heads, meta.max_kv_splits),
        (
            q, k_buffer, v_buffer, partial_out, partial_lse,
            meta.kv_indptr, meta.kv_indices, meta.num_kv_splits,
            scaling * LOG2_E,
            sliding_window or 0,
            heads_per_kv_head,
            q.stride(0), q.stride(1),
            k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
        ),
        dict(
            HEAD_DIM=head_dim,
            HAS_WINDOW=sliding_window is not None,
            DOT_IN_FP32=dot_in_fp32(arch, q.dtype),
            BLOCK_H=decode_head_tile(heads_per_kv_head),
            BLOCK_N=tiles.block_n,
            BLOCK_D=block_d,
            **tiles.launch_options(),
        ),
    )
    reduce = KernelLaunch(
        _decode_reduce_kernel,
        (num_queries, num_heads),
        (
            partial_out, partial_lse, out, meta.num_kv_splits,
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            out.stride(0), out.stride(1),
        ),
        dict(HEAD_DIM=head_dim, BLOCK_S=pow2_at_least(meta.max_kv_splits, 2), BLOCK_D=block_d),
    )
    return partial, reduce


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: TritonAttnMetadata,
    *,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q `[queries, heads, head_dim]` (one row per segment) -> like q."""
    num_queries = q.shape[0]
    if num_queries != meta.num_queries:
        raise ValueError(
            f"decode got {num_queries} query rows but the batch metadata has "
            f"{meta.num_queries} KV lists"
        )
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    for launch in decode_launches(
        q, k_buffer, v_buffer, out, meta, scaling=scaling, sliding_window=sliding_window,
        arch=kernel_arch(_decode_partial_kernel, q.device),
    ):
        launch.run()
    return out
