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
  step through all of them in one call, each layer's `decode_step` with its plan. Over few
  rows that call is one OpenMP region (`csrc/team.h`): the kernels' parallel loops go to its
  waiting threads, which read the next projection's weights ahead while the calling thread
  runs the serial work between the kernels (`set_team` turns it off). Past the
  few-row kernel it also takes a decode batch whose dense projections the op-by-op path
  multiplies with a batch kernel (`takes_batch`: the bf16 AMX linear, the panel
  GEMM, against their cached packs; `plugserve.kernels.decode_batch`), or whose projections
  are all quantized (the many-row quantized path, as the op-by-op path runs it).

It takes the Llama form of the layer (no q/k norms, no sandwich norms, SiLU, plain RMSNorm
weights) where the few-row linear kernel applies (`plugserve.kernels.skinny_linear`). A
projection's weight (`ProjWeight`) is dense, or GGML blocks stacked along its outputs
(`plugserve.model.quant_weight`), multiplied by the few-row quantized kernel
(`plugserve.kernels.quant_linear`) with int8 or float activations, as the op-by-op path does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.kernels import build, dense_amx, paged_decode
from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels import panel_gemm as panel
from plugserve.kernels import quant_linear as quant
from plugserve.kernels import skinny_linear as skinny
from plugserve.kernels.decode_batch import BatchPacks
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations

# A projection's weight: dense [outputs, inputs], or block-quantized parts stacked along the
# outputs (a `WeightHolder`'s `matrix`).
ProjWeight = torch.Tensor | tuple[QuantBlocks, ...]


def available() -> bool:
    """True when the kernel is built for this CPU (compiling it the first time)."""
    return build.library() is not None


def why_unavailable() -> str | None:
    return build.unavailable_reason()


def set_team(enabled: bool) -> bool:
    """Whether a few-row stack call runs in one team (`csrc/team.h`); the previous setting.
    Off, each kernel opens its own parallel region: the same values, for A/B timing."""
    return bool(_module().set_team(enabled))


def read_ahead_bytes() -> int:
    """Weight bytes the teams' waiting threads have read ahead since the process started."""
    return int(_module().team_read_ahead_bytes())


def applies(hidden: torch.Tensor, qkv_weight: ProjWeight, cos: torch.Tensor) -> bool:
    """True when a layer whose qkv projection is `qkv_weight` should run its step of
    `hidden` [rows, hidden_size] (rope angles `cos`) here: the few-row linear (dense or
    quantized) takes these rows and this dtype, and no gradient is wanted. (The caller also
    checks that its dense weights are read as stored: see
    `plugserve.model.layers.multiplies_as_stored`.)"""
    if cos.dtype != hidden.dtype:
        return False
    if isinstance(qkv_weight, tuple):
        return (
            not (torch.is_grad_enabled() and hidden.requires_grad)
            and hidden.ndim == 2 and hidden.is_cpu and 0 < hidden.shape[0] <= quant.MAX_FEW_ROWS
            and hidden.dtype in (torch.float32, torch.bfloat16) and available()
        )
    if torch.is_grad_enabled() and (hidden.requires_grad or qkv_weight.requires_grad):
        return False
    return skinny.applies(hidden, qkv_weight)


def op_weight(weight: ProjWeight) -> tuple[list[torch.Tensor], list[str]]:
    """A projection's weight as the compiled ops take it: its tensors and their block formats
    (none for a dense weight)."""
    if isinstance(weight, tuple):
        return [p.data for p in weight], [p.qtype.name for p in weight]
    return [weight], []


def linear_reference(
    x: torch.Tensor, weight: ProjWeight, bias: torch.Tensor | None, activations: Activations,
) -> torch.Tensor:
    """The op-by-op path's projection: the few-row linear, dense or quantized (each part
    with its slice of the bias, the outputs joined, as `quant_weight.quant_matmul` does);
    past its rows a dense weight's batch linear, as `plugserve.model.layers.linear` picks,
    and a quantized one's many-row path (`quant_linear.quant_linear` picks by rows)."""
    if not isinstance(weight, tuple):
        if skinny.applies(x, weight):
            return skinny.skinny_linear(x, weight, bias)
        if panel.applies(x, weight):
            return panel.panel_gemm(x, weight, bias)
        if dense_amx.applies(x, weight):
            return dense_amx.dense_amx_linear(x, weight, bias)
        raise ValueError(f"no few-row or batch kernel takes {x.shape[0]} rows of {x.dtype} "
                         "here (the op-by-op path would use oneDNN or the widening GEMM)")
    outs, row = [], 0
    for part in weight:
        part_bias = None if bias is None else bias[row : row + part.rows]
        outs.append(quant.quant_linear(x, part, part_bias, activations))
        row += part.rows
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _module() -> Any:
    return build.ops()


def attention_input(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: ProjWeight,
    qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    rotated_heads: int, head_dim: int, activations: Activations = "int8",
) -> torch.Tensor:
    """qkv [rows, outputs] = rms_norm(hidden) @ qkv_weight.T (+ qkv_bias), with its first
    `rotated_heads` heads of `head_dim` (q then k) rotated by cos / sin ([rows, head_dim // 2])."""
    qkv: torch.Tensor = _module().attention_input(
        hidden, norm_weight, eps, *op_weight(qkv_weight), qkv_bias, cos, sin, rotated_heads,
        head_dim, activations == "int8",
    )
    return qkv


def attention_output_and_mlp(
    attn: torch.Tensor, o_weight: ProjWeight, o_bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_up_weight: ProjWeight, gate_up_bias: torch.Tensor | None,
    down_weight: ProjWeight, down_bias: torch.Tensor | None, activations: Activations = "int8",
) -> torch.Tensor:
    """The layer's output: h + down(silu(gate(x)) * up(x)) for h = residual + attn @ o.T and
    x = rms_norm(h); gate and up are the halves of the fused gate_up projection."""
    out: torch.Tensor = _module().attention_output_and_mlp(
        attn, *op_weight(o_weight), o_bias, residual, norm_weight, eps,
        *op_weight(gate_up_weight), gate_up_bias, *op_weight(down_weight), down_bias,
        activations == "int8",
    )
    return out


def decode_step(
    hidden: torch.Tensor, input_norm_weight: torch.Tensor, input_eps: float,
    qkv_weight: ProjWeight, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, plan: PagedDecodePlan,
    o_weight: ProjWeight, o_bias: torch.Tensor | None, post_norm_weight: torch.Tensor,
    post_eps: float, gate_up_weight: ProjWeight, gate_up_bias: torch.Tensor | None,
    down_weight: ProjWeight, down_bias: torch.Tensor | None, activations: Activations = "int8",
) -> torch.Tensor:
    """The whole layer for a decode step: `attention_input`, the new k and v stored and the
    paged-decode attention as `plan` describes them, then `attention_output_and_mlp`."""
    out: torch.Tensor = _module().decode_step(
        hidden, input_norm_weight, input_eps, *op_weight(qkv_weight), qkv_bias, cos, sin,
        heads, kv_heads, head_dim, plan.k_buffer, plan.v_buffer, plan.store_slots, plan.slots,
        plan.first_key, plan.kv_lens, plan.scale, *op_weight(o_weight), o_bias,
        post_norm_weight, post_eps, *op_weight(gate_up_weight), gate_up_bias,
        *op_weight(down_weight), down_bias, activations == "int8",
    )
    return out


def attention_input_reference(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: ProjWeight,
    qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    rotated_heads: int, head_dim: int, activations: Activations = "int8",
) -> torch.Tensor:
    """The op-by-op path: the fused norm, the few-row linear, rope in place."""
    normed = fused.rms_norm(hidden, norm_weight, eps)
    qkv = linear_reference(normed, qkv_weight, qkv_bias, activations)
    qk = qkv[:, : rotated_heads * head_dim].view(qkv.shape[0], rotated_heads, head_dim)
    fused.rope_(qk, cos, sin)
    return qkv


def attention_output_and_mlp_reference(
    attn: torch.Tensor, o_weight: ProjWeight, o_bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_up_weight: ProjWeight, gate_up_bias: torch.Tensor | None,
    down_weight: ProjWeight, down_bias: torch.Tensor | None, activations: Activations = "int8",
) -> torch.Tensor:
    """The op-by-op path, as `DecoderLayer.forward` runs it."""
    out = linear_reference(attn, o_weight, o_bias, activations)
    mlp_in, hidden = fused.add_rms_norm(out, residual, norm_weight, eps)
    gate_up = linear_reference(mlp_in, gate_up_weight, gate_up_bias, activations)
    mlp = linear_reference(fused.silu_mul(gate_up), down_weight, down_bias, activations)
    return hidden + mlp


def decode_step_reference(
    hidden: torch.Tensor, input_norm_weight: torch.Tensor, input_eps: float,
    qkv_weight: ProjWeight, qkv_bias: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, plan: PagedDecodePlan,
    o_weight: ProjWeight, o_bias: torch.Tensor | None, post_norm_weight: torch.Tensor,
    post_eps: float, gate_up_weight: ProjWeight, gate_up_bias: torch.Tensor | None,
    down_weight: ProjWeight, down_bias: torch.Tensor | None, activations: Activations = "int8",
) -> torch.Tensor:
    """The op-by-op path, as the layer and a backend's `forward` run it."""
    qkv = attention_input_reference(
        hidden, input_norm_weight, input_eps, qkv_weight, qkv_bias, cos, sin,
        heads + kv_heads, head_dim, activations,
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
        gate_up_weight, gate_up_bias, down_weight, down_bias, activations,
    )


@dataclass(frozen=True)
class LayerWeights:
    """One Llama-form decoder layer as `decode_step` takes it: its norms, projections and
    attention shape (the parameters themselves, not copies), and the activations its quantized
    projections take."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: ProjWeight
    qkv_bias: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    o: ProjWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    gate_up: ProjWeight
    gate_up_bias: torch.Tensor | None
    down: ProjWeight
    down_bias: torch.Tensor | None
    activations: Activations = "int8"

    def attention_input(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`attention_input` with this layer's weights: qkv with q and k rotated."""
        return attention_input(
            hidden, self.input_norm, self.input_eps, self.qkv, self.qkv_bias, cos, sin,
            self.heads + self.kv_heads, self.head_dim, self.activations,
        )

    def attention_output_and_mlp(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """`attention_output_and_mlp` with this layer's weights."""
        return attention_output_and_mlp(
            attn, self.o, self.o_bias, residual, self.post_norm, self.post_eps, self.gate_up,
            self.gate_up_bias, self.down, self.down_bias, self.activations,
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
            self.down_bias, self.activations,
        )


class DecodeStack:
    """A model's decoder layers for decode steps in one compiled call each (`run`).

    It holds the layers' parameters as tensors (in-place writes to them are seen, and make
    the batch packs be asked for again); a model that replaces a parameter object builds a
    new stack."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        self.layers = tuple(layers)
        f = self.layers
        library = build.library()
        if library is None:
            raise RuntimeError(f"the decode_layer CPU kernel is unavailable: {why_unavailable()}")
        qkv, o, gate_up, down = (
            [op_weight(getattr(w, name)) for w in f] for name in ("qkv", "o", "gate_up", "down")
        )
        self._stack = library.decode_stack_class(
            [w.input_norm for w in f], [w.input_eps for w in f], [p for p, _ in qkv],
            [n for _, n in qkv], [w.qkv_bias for w in f], [w.heads for w in f],
            [w.kv_heads for w in f], [w.head_dim for w in f], [p for p, _ in o],
            [n for _, n in o], [w.o_bias for w in f], [w.post_norm for w in f],
            [w.post_eps for w in f], [p for p, _ in gate_up], [n for _, n in gate_up],
            [w.gate_up_bias for w in f], [p for p, _ in down], [n for _, n in down],
            [w.down_bias for w in f], [int(w.activations == "int8") for w in f],
        )
        self._batch = BatchPacks([_dense_matrices(w) for w in f], all(
            isinstance(getattr(w, name), tuple) for w in f
            for name in ("qkv", "o", "gate_up", "down")))
        # What set_kv gave the compiled stack last: every layer's (k, v) buffers and scales.
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor], list[float]] | None = None

    def takes_batch(self, hidden: torch.Tensor) -> bool:
        """True when `run` takes `hidden`'s rows past the few-row kernel: the op-by-op path
        multiplies every projection of them with this stack's batch kernel (bf16 on AMX,
        panel GEMM)."""
        return self._batch.takes(hidden)

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        plans: Sequence[PagedDecodePlan],
    ) -> torch.Tensor:
        """`hidden` [rows, hidden_size] after every layer's `decode_step`, layer i's attention
        being `plans[i]` and its rope angles cos / sin. Rows past the few-row kernel must be
        a batch the stack takes (`takes_batch`)."""
        rows = hidden.shape[0]
        batch = rows > quant.MAX_FEW_ROWS
        if batch:
            if not self._batch.takes(hidden):
                raise ValueError(
                    f"DecodeStack.run: {rows} rows of {hidden.dtype} are past the few-row "
                    f"kernel ({quant.MAX_FEW_ROWS} rows) and no batch kernel of this stack "
                    "takes them (see takes_batch)")
            packs = self._batch.packs_if_changed()
            if packs is not None:
                self._stack.set_packs(*packs)
        first = plans[0] if plans else None
        if first is not None and len(plans) == len(self.layers) and all(
            p.store_slots is first.store_slots and p.slots is first.slots
            and p.first_key is first.first_key and p.kv_lens is first.kv_lens for p in plans
        ):
            # Every layer stores at and reads the same slots: the buffers and scales are held
            # by the compiled stack (they stay from step to step), the slots passed once.
            self._set_kv(plans)
            shared: torch.Tensor = self._stack.run_shared(
                hidden, cos, sin, first.store_slots, first.slots, first.first_key,
                first.kv_lens, batch)
            return shared
        out: torch.Tensor = self._stack.run(
            hidden, cos, sin, [p.k_buffer for p in plans], [p.v_buffer for p in plans],
            [p.store_slots for p in plans], [p.slots for p in plans],
            [p.first_key for p in plans], [p.kv_lens for p in plans], [p.scale for p in plans],
            batch,
        )
        return out

    def _set_kv(self, plans: Sequence[PagedDecodePlan]) -> None:
        """Hand the plans' KV buffers and scales to the compiled stack where they moved."""
        held = self._kv
        if held is not None and all(
            p.k_buffer is k and p.v_buffer is v and p.scale == s
            for p, k, v, s in zip(plans, *held, strict=True)
        ):
            return
        kv = ([p.k_buffer for p in plans], [p.v_buffer for p in plans], [p.scale for p in plans])
        self._stack.set_kv(*kv)
        self._kv = kv

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


def _dense_matrices(
    w: LayerWeights,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A layer's four projection matrices, or None if any is quantized."""
    qkv, o, gate_up, down = w.qkv, w.o, w.gate_up, w.down
    if (isinstance(qkv, torch.Tensor) and isinstance(o, torch.Tensor)
            and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return qkv, o, gate_up, down
    return None
