"""A Llama decoder layer in one or two compiled calls, for decode steps on the CPU.

Run op by op from Python, one decoder layer at batch 1 spends ~70 us per step in the
interpreter and in dispatch, next to a few microseconds of work above its weight stream: over
30 layers that is a sixth of a bf16 step. `csrc/decode_layer.cpp` runs the same kernels back
to back in C++, with results identical to the op-by-op path (its reference here, and the
path everywhere `applies` says no):

- `attention_input`: the input norm, the fused qkv projection and rope on q and k;
- `attention_output_and_mlp`: the output projection joined to the residual stream, the
  post-attention norm, the gated SiLU MLP and its residual add;
- `decode_step`: both, with the attention between them, where the backend's decode attention
  is the paged-decode kernel over plain tensors (its `PagedDecodePlan`): the KV store and
  `plugserve.kernels.paged_decode` run inside the same call.

It takes the Llama form of the layer (no q/k norms, no sandwich norms, SiLU, plain RMSNorm
weights) where the few-row linear kernel applies (`plugserve.kernels.skinny_linear`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from plugserve.attention.base import PagedDecodePlan
from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels import paged_decode
from plugserve.kernels import skinny_linear as skinny
from plugserve.kernels.build import load_vectorised, vectorised_unavailable_reason

KERNEL = "decode_layer"


def _kernel() -> ModuleType | None:
    return load_vectorised(KERNEL)


def available() -> bool:
    """True when the kernel is built for this CPU (compiling it the first time)."""
    return _kernel() is not None


def why_unavailable() -> str | None:
    return vectorised_unavailable_reason(KERNEL)


def applies(hidden: torch.Tensor, qkv_weight: torch.Tensor, cos: torch.Tensor) -> bool:
    """True when a layer whose qkv projection is `qkv_weight` should run its step of
    `hidden` [rows, hidden_size] (rope angles `cos`) here: the few-row linear takes these rows
    and this dtype, and no gradient is wanted. (The caller also checks that its weights are
    multiplied as stored, not through a float32 copy: see `plugserve.model.layers`.)"""
    if torch.is_grad_enabled() and (hidden.requires_grad or qkv_weight.requires_grad):
        return False
    if cos.dtype != hidden.dtype:
        return False
    return skinny.applies(hidden, qkv_weight) and _kernel() is not None


def _module() -> ModuleType:
    module = _kernel()
    if module is None:
        raise RuntimeError(f"the decode_layer CPU kernel is unavailable: {why_unavailable()}")
    return module


def attention_input(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    rotated_heads: int, head_dim: int,
) -> torch.Tensor:
    """qkv [rows, outputs] = rms_norm(hidden) @ qkv_weight.T (+ qkv_bias), with its first
    `rotated_heads` heads of `head_dim` (q then k) rotated by cos / sin ([rows, head_dim // 2])."""
    qkv: torch.Tensor = _module().attention_input(
        hidden, norm_weight, eps, qkv_weight, qkv_bias, cos, sin, rotated_heads, head_dim
    )
    return qkv


def attention_output_and_mlp(
    attn: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The layer's output: h + down(silu(gate(x)) * up(x)) for h = residual + attn @ o.T and
    x = rms_norm(h); gate and up are the halves of the fused gate_up projection."""
    out: torch.Tensor = _module().attention_output_and_mlp(
        attn, o_weight, o_bias, residual, norm_weight, eps, gate_up_weight, gate_up_bias,
        down_weight, down_bias,
    )
    return out


def decode_step(
    hidden: torch.Tensor, input_norm_weight: torch.Tensor, input_eps: float,
    qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, plan: PagedDecodePlan,
    o_weight: torch.Tensor, o_bias: torch.Tensor | None, post_norm_weight: torch.Tensor,
    post_eps: float, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The whole layer for a decode step: `attention_input`, the new k and v stored and the
    paged-decode attention as `plan` describes them, then `attention_output_and_mlp`."""
    out: torch.Tensor = _module().decode_step(
        hidden, input_norm_weight, input_eps, qkv_weight, qkv_bias, cos, sin, heads, kv_heads,
        head_dim, plan.k_buffer, plan.v_buffer, plan.store_slots, plan.slots, plan.first_key,
        plan.kv_lens, plan.scale, o_weight, o_bias, post_norm_weight, post_eps, gate_up_weight,
        gate_up_bias, down_weight, down_bias,
    )
    return out


def attention_input_reference(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    rotated_heads: int, head_dim: int,
) -> torch.Tensor:
    """The op-by-op path: the fused norm, the few-row linear, rope in place."""
    qkv = skinny.skinny_linear(fused.rms_norm(hidden, norm_weight, eps), qkv_weight, qkv_bias)
    qk = qkv[:, : rotated_heads * head_dim].view(qkv.shape[0], rotated_heads, head_dim)
    fused.rope_(qk, cos, sin)
    return qkv


def attention_output_and_mlp_reference(
    attn: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op-by-op path, as `DecoderLayer.forward` runs it."""
    out = skinny.skinny_linear(attn, o_weight, o_bias)
    mlp_in, hidden = fused.add_rms_norm(out, residual, norm_weight, eps)
    gate_up = skinny.skinny_linear(mlp_in, gate_up_weight, gate_up_bias)
    return hidden + skinny.skinny_linear(fused.silu_mul(gate_up), down_weight, down_bias)


def decode_step_reference(
    hidden: torch.Tensor, input_norm_weight: torch.Tensor, input_eps: float,
    qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, plan: PagedDecodePlan,
    o_weight: torch.Tensor, o_bias: torch.Tensor | None, post_norm_weight: torch.Tensor,
    post_eps: float, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op-by-op path, as the layer and a backend's `forward` run it."""
    qkv = attention_input_reference(
        hidden, input_norm_weight, input_eps, qkv_weight, qkv_bias, cos, sin,
        heads + kv_heads, head_dim,
    )
    rows, q_width, kv_width = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    k = qkv[:, q_width : q_width + kv_width].view(rows, kv_heads, head_dim)
    v = qkv[:, q_width + kv_width :].view(rows, kv_heads, head_dim)
    plan.k_buffer.index_copy_(0, plan.store_slots, k)
    plan.v_buffer.index_copy_(0, plan.store_slots, v)
    attn = paged_decode.paged_decode(
        qkv[:, :q_width].view(rows, heads, head_dim), plan.k_buffer, plan.v_buffer, plan.slots,
        plan.first_key, plan.kv_lens, plan.scale,
    )
    return attention_output_and_mlp_reference(
        attn.reshape(rows, q_width), o_weight, o_bias, hidden, post_norm_weight, post_eps,
        gate_up_weight, gate_up_bias, down_weight, down_bias,
    )
