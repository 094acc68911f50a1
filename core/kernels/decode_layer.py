"""A Llama decoder layer in one or two compiled calls, for decode steps on the CPU.

Run op by op from Python, one decoder layer at batch 1 spends ~70 us per step in the
interpreter and in dispatch, next to a few microseconds of work above its weight stream: over
30 layers that is a sixth of a bf16 step. `csrc/ops/decode_layer.cpp` runs the same kernels
back to back in C++, with results identical to the op-by-op path (its reference here, and the
path everywhere `applies` says no):

- `attention_input`: the input norm, the fused qkv projection and rope on q and k;
- `attention_output_and_mlp`: the output projection joined to the residual stream, the
  post-attention norm, the gated SiLU MLP and its residual add;
- `decode_step`: both, with the attention between them, where the backend's decode attention
  is the paged-decode kernel over plain tensors (its `PagedDecodePlan`): the KV store and
  `plugserve.kernels.paged_decode` run inside the same call;
- `DecodeStack`: a model's layers held once (`LayerWeights`), whose `run` takes a decode
  step through all of them in one call, each layer's `decode_step` with its plan.

It takes the Llama form of the layer (no q/k norms, no sandwich norms, SiLU, plain RMSNorm
weights) where the few-row linear kernel applies (`plugserve.kernels.skinny_linear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.kernels import build, paged_decode
from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels import skinny_linear as skinny
from plugserve.kernels.paged_decode import PagedDecodePlan


def available() -> bool:
    """True when the kernel is built for this CPU (compiling it the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def applies(hidden: torch.Tensor, qkv_weight: torch.Tensor, cos: torch.Tensor) -> bool:
    """True when a layer whose qkv projection is `qkv_weight` should run its step of
    `hidden` [rows, hidden_size] (rope angles `cos`) here: the few-row linear takes these rows
    and this dtype, and no gradient is wanted. (The caller also checks that its weights are
    read as stored: see `plugserve.model.layers.multiplies_as_stored`.)"""
    if torch.is_grad_enabled() and (hidden.requires_grad or qkv_weight.requires_grad):
        return False
    if cos.dtype != hidden.dtype:
        return False
    return skinny.applies(hidden, qkv_weight)


def _module() -> Any:
    return build.ops()


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


@dataclass(frozen=True)
class LayerWeights:
    """One Llama-form decoder layer as `decode_step` takes it: its norms, projections and
    attention shape (the parameters themselves, not copies)."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    def attention_input(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`attention_input` with this layer's weights: qkv with q and k rotated."""
        return attention_input(
            hidden, self.input_norm, self.input_eps, self.qkv, self.qkv_bias, cos, sin,
            self.heads + self.kv_heads, self.head_dim,
        )

    def attention_output_and_mlp(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """`attention_output_and_mlp` with this layer's weights."""
        return attention_output_and_mlp(
            attn, self.o, self.o_bias, residual, self.post_norm, self.post_eps, self.gate_up,
            self.gate_up_bias, self.down, self.down_bias,
        )

    def decode_step(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        plan: PagedDecodePlan, *, reference: bool = False,
    ) -> torch.Tensor:
        """`decode_step` with this layer's weights (`decode_step_reference` if `reference`)."""
        step = decode_step_reference if reference else decode_step
        return step(
            hidden, self.input_norm, self.input_eps, self.qkv, self.qkv_bias, cos, sin,
            self.heads, self.kv_heads, self.head_dim, plan, self.o, self.o_bias,
            self.post_norm, self.post_eps, self.gate_up, self.gate_up_bias, self.down,
            self.down_bias,
        )


class DecodeStack:
    """A model's decoder layers for decode steps in one compiled call each (`run`).

    It holds the layers' parameters as tensors (in-place writes to them are seen); a model
    that replaces a parameter object builds a new stack."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        self.layers = tuple(layers)
        f = self.layers
        library = build.library()
        if library is None:
            raise RuntimeError(f"the decode_layer CPU kernel is unavailable: {why_unavailable()}")
        self._stack = library.decode_stack_class(
            [w.input_norm for w in f], [w.input_eps for w in f], [w.qkv for w in f],
            [w.qkv_bias for w in f], [w.heads for w in f], [w.kv_heads for w in f],
            [w.head_dim for w in f], [w.o for w in f], [w.o_bias for w in f],
            [w.post_norm for w in f], [w.post_eps for w in f], [w.gate_up for w in f],
            [w.gate_up_bias for w in f], [w.down for w in f], [w.down_bias for w in f],
        )

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        plans: Sequence[PagedDecodePlan],
    ) -> torch.Tensor:
        """`hidden` [rows, hidden_size] after every layer's `decode_step`, layer i's attention
        being `plans[i]` and its rope angles cos / sin."""
        out: torch.Tensor = self._stack.run(
            hidden, cos, sin, [p.k_buffer for p in plans], [p.v_buffer for p in plans],
            [p.store_slots for p in plans], [p.slots for p in plans],
            [p.first_key for p in plans], [p.kv_lens for p in plans], [p.scale for p in plans],
        )
        return out

    def run_reference(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        plans: Sequence[PagedDecodePlan],
    ) -> torch.Tensor:
        """The same through `decode_step_reference`, one layer at a time."""
        if len(plans) != len(self.layers):
            raise ValueError(f"one plan per layer is needed ({len(self.layers)} layers), "
                             f"got {len(plans)}")
        for w, plan in zip(self.layers, plans, strict=True):
            hidden = w.decode_step(hidden, cos, sin, plan, reference=True)
        return hidden
