"""The Llama-family causal LM (Llama, Qwen2, Qwen3, Mistral, Gemma 3) over a paged KV cache.

Tokens of all requests in a batch are flattened into one [num_tokens, hidden] tensor; the
attention backend is the only part that knows which tokens belong to which request. Each
attention layer computes q, k and v with one fused projection, applies rope, and hands
q [num_tokens, num_heads, head_dim] and k/v [num_tokens, num_kv_heads, head_dim] to
`backend.forward`, which stores k/v in the cache and returns the attention output.

Gemma 3 is the same decoder with switches from `ModelArchConfig`: (1 + w) norms, a norm
on each sub-layer's output as well as its input ("sandwich" norms), a GELU-tanh MLP, scaled
token embeddings, a rope of its own for the sliding-window layers and final logit
soft-capping. Its attention scale (query_pre_attn_scalar) and windows reach the backend
through the `AttentionLayer`s.

Parameters are allocated without initial values; a loader fills every one of them
(see `plugserve.model.weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from plugserve.attention.base import AttentionBackend, AttentionLayer
from plugserve.kernels import decode_layer
from plugserve.kernels import fused_elementwise as fused
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.model.arch import ModelArchConfig
from plugserve.model.layers import (
    Device,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    WeightHolder,
    linear,
    multiplies_as_stored,
    parameter_generation,
)
from plugserve.model.rope import RotaryEmbedding, apply_rope
from plugserve.structs.forward_batch import ForwardBatch


@dataclass
class CausalLMOutput:
    # float32 [rows, vocab]; rows = forward_batch.logits_indices, or every token when None
    logits: torch.Tensor
    # the last decoder layer's output before the final norm, same rows; only when
    # forward_batch.capture_hidden (EAGLE draft heads read it)
    hidden_states: torch.Tensor | None = None
    # the same pre-norm hidden state for every token of the batch, [num_tokens, hidden]; only
    # when forward_batch.capture_hidden (a draft head catches up on every new token)
    token_hidden_states: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, layer: AttentionLayer, dtype: torch.dtype, device: Device
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.qkv_proj = Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias,
            dtype=dtype, device=device,
        )
        self.o_proj = Linear(
            arch.q_size, arch.hidden_size, bias=arch.attention_out_bias, dtype=dtype,
            device=device,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = _norm(arch, arch.head_dim, dtype, device)
            self.k_norm = _norm(arch, arch.head_dim, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qk, v = self.split_qkv(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        if fused.applies(qk, cos, sin):  # in place, where the projection left q and k
            fused.rope_(qk, cos, sin)
        else:
            qk = apply_rope(qk, cos, sin)
        return self.o_proj(self.attend(qk, v, forward_batch, backend))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a qkv projection output: qk [tokens, H + KVH, head_dim] (q and k side by
        side, so that they are rotated together) and v [tokens, KVH, head_dim]."""
        num_tokens, qk_width = qkv.shape[0], self.q_size + self.kv_size
        qk = qkv[:, :qk_width].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        return qk, qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)

    def attend(
        self, qk: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The backend's attention for rotated q and k: [tokens, q_size], before o_proj."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = backend.forward(q, k, v, self.layer, forward_batch)
        return out.reshape(qk.shape[0], self.q_size)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. With `arch.sandwich_norms` (Gemma 3) the names are
    HF Gemma's: post_attention_layernorm norms the attention output, pre_feedforward_layernorm
    the MLP input and post_feedforward_layernorm the MLP output; otherwise (Llama)
    post_attention_layernorm is the norm of the MLP input."""

    def __init__(
        self, arch: ModelArchConfig, layer: AttentionLayer, dtype: torch.dtype, device: Device
    ) -> None:
        super().__init__()
        self.input_layernorm = _norm(arch, arch.hidden_size, dtype, device)
        self.self_attn = Attention(arch, layer, dtype, device)
        self.post_attention_layernorm = _norm(arch, arch.hidden_size, dtype, device)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(arch, arch.hidden_size, dtype, device)
            self.post_feedforward_layernorm = _norm(arch, arch.hidden_size, dtype, device)
        self.mlp = GatedMLP(
            arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias, dtype=dtype,
            device=device, activation=arch.hidden_act,
        )
        # The Llama form of the layer, which `plugserve.kernels.decode_layer` runs in one or
        # two compiled calls for the few rows of a decode step.
        self.has_llama_form = (
            not arch.sandwich_norms and not arch.qk_norm and not arch.norm_unit_offset
            and arch.hidden_act == "silu"
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.has_llama_form and _few_rows_apply(hidden, self.self_attn.qkv_proj.matrix, cos):
            plan = backend.paged_decode_plan(self.self_attn.layer, forward_batch)
            return self.forward_few_rows(hidden, cos, sin, forward_batch, backend, plan)
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, forward_batch, backend)
        pre_mlp, post_mlp = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        # The residual add and the norm after it are one fused step (`RMSNorm.add_and_norm`).
        if pre_mlp is None or post_mlp is None:
            mlp_in, hidden = self.post_attention_layernorm.add_and_norm(attn, hidden)
            return hidden + self.mlp(mlp_in)
        mlp_in, hidden = pre_mlp.add_and_norm(self.post_attention_layernorm(attn), hidden)
        return hidden + post_mlp(self.mlp(mlp_in))

    def decode_weights(self) -> decode_layer.LayerWeights:
        """This (Llama-form) layer's parameters as the compiled decode step takes them (a
        quantized projection's blocks as they are held)."""
        attn, mlp = self.self_attn, self.mlp
        input_norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        return decode_layer.LayerWeights(
            input_norm.weight, input_norm.eps, attn.qkv_proj.matrix, attn.qkv_proj.bias,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.o_proj.matrix,
            attn.o_proj.bias, post_norm.weight, post_norm.eps, mlp.gate_up_proj.matrix,
            mlp.gate_up_proj.bias, mlp.down_proj.matrix, mlp.down_proj.bias,
            attn.qkv_proj.quant_activations,
        )

    def forward_few_rows(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        backend: AttentionBackend,
        plan: PagedDecodePlan | None,
    ) -> torch.Tensor:
        """`forward` of a Llama-form layer in compiled code: one call where the backend's
        decode attention is the paged-decode kernel (its `plan`), else two around the
        backend's `forward`. The same kernels in the same order, without a dozen Python steps
        between them."""
        weights = self.decode_weights()
        if plan is not None:  # the KV cache holds the model's dtype (checked in the kernel)
            return weights.decode_step(hidden, cos, sin, plan)
        attn = self.self_attn
        qkv = weights.attention_input(hidden, cos, sin)
        out = attn.attend(*attn.split_qkv(qkv), forward_batch, backend)
        return weights.attention_output_and_mlp(out, hidden)


def _few_rows_apply(
    hidden: torch.Tensor, qkv_weight: decode_layer.ProjWeight, cos: torch.Tensor
) -> bool:
    """Whether a Llama-form layer runs these rows through `plugserve.kernels.decode_layer`
    (a quantized projection always multiplies as stored)."""
    return decode_layer.applies(hidden, qkv_weight, cos) and (
        isinstance(qkv_weight, tuple) or multiplies_as_stored(qkv_weight))


def _batch_rows_apply(
    hidden: torch.Tensor, qkv_weight: decode_layer.ProjWeight, cos: torch.Tensor
) -> bool:
    """Whether these rows, past the few-row kernels, may go through the decode stack: weights
    read as stored (quantized ones always are), rope angles of the layer's dtype (the stack's
    `takes_batch` says whether its batch kernels take the rows)."""
    return (
        (isinstance(qkv_weight, tuple) or multiplies_as_stored(qkv_weight))
        and cos.dtype == hidden.dtype and hidden.ndim == 2 and hidden.is_cpu
        and decode_layer.available()
    )


def _norm(arch: ModelArchConfig, size: int, dtype: torch.dtype, device: Device) -> RMSNorm:
    return RMSNorm(
        size, arch.rms_norm_eps, dtype=dtype, device=device, unit_offset=arch.norm_unit_offset
    )


class CausalLM(nn.Module):
    """A Llama-family decoder with an LM head; `arch` says which variant."""

    embed_scale: torch.Tensor | None

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
    ) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, layer, dtype, device) for layer in arch.attention_layers()
        )
        self.final_norm = _norm(arch, arch.hidden_size, dtype, device)
        self.lm_head: Linear | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(
                arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype, device=device
            )
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling,
            dtype=dtype, device=device,
        )
        # The sliding-window layers' own rope (Gemma 3), if they have one.
        self.local_rotary: RotaryEmbedding | None = None
        if arch.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                arch.head_dim, arch.max_position_embeddings, arch.local_rope_theta,
                arch.local_rope_scaling, dtype=dtype, device=device,
            )
        self.uses_local_rope = [arch.layer_uses_local_rope(i) for i in range(len(self.layers))]
        # Decode steps through `plugserve.kernels.decode_layer`'s stack (one rope for all).
        self.all_llama_form = (
            len(self.layers) > 0 and self.local_rotary is None
            and all(layer.has_llama_form for layer in self.layers)
        )
        self._stack: decode_layer.DecodeStack | None = None
        self._attention_layers: list[AttentionLayer] | None = None
        self._stack_generation = -1
        # Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model dtype.
        scale = None
        if arch.embedding_scale != 1.0:
            scale = torch.tensor(arch.embedding_scale, dtype=torch.float32).to(dtype)
        self.register_buffer(
            "embed_scale", None if scale is None else scale.to(device), persistent=False
        )

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def _decode_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        forward_batch: ForwardBatch, backend: AttentionBackend,
    ) -> torch.Tensor:
        """Every (Llama-form) layer over the few rows of a decode step in compiled code: one
        call for the whole stack where the backend plans every layer's attention, else each
        layer's `forward_few_rows`."""
        plans = self._decode_plans(forward_batch, backend)
        planned = [plan for plan in plans if plan is not None]
        if len(planned) == len(plans):
            return self._decode_stack().run(hidden, cos, sin, planned)
        for layer, plan in zip(self.decoder_layers, plans, strict=True):
            hidden = layer.forward_few_rows(hidden, cos, sin, forward_batch, backend, plan)
        return hidden

    def _decode_batch(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        forward_batch: ForwardBatch, backend: AttentionBackend,
    ) -> torch.Tensor | None:
        """A decode batch past the few-row kernels through the stack in one call, where its
        batch kernels take the rows and the backend plans every layer's attention; else None
        (the layers run op by op)."""
        if not forward_batch.mode.is_decode():
            return None
        stack = self._decode_stack()
        if not stack.takes_batch(hidden):
            return None
        plans = self._decode_plans(forward_batch, backend)
        planned = [plan for plan in plans if plan is not None]
        if len(planned) != len(plans):
            return None
        return stack.run(hidden, cos, sin, planned)

    def _decode_plans(
        self, forward_batch: ForwardBatch, backend: AttentionBackend
    ) -> list[PagedDecodePlan | None]:
        """Each layer's paged-decode plan from the backend (None where it has none)."""
        if self._attention_layers is None:  # looked up once: a step has no time for modules
            self._attention_layers = [layer.self_attn.layer for layer in self.decoder_layers]
        return [backend.paged_decode_plan(attn, forward_batch) for attn in self._attention_layers]

    def _decode_stack(self) -> decode_layer.DecodeStack:
        """The layers held for one-call decode steps; built again once a parameter object
        anywhere is replaced (in-place weight writes need nothing: it shares the storage and
        asks for new batch packs itself)."""
        generation = parameter_generation()
        if self._stack is None or self._stack_generation != generation:
            self._stack = decode_layer.DecodeStack(
                [layer.decode_weights() for layer in self.decoder_layers]
            )
            self._stack_generation = generation
        return self._stack

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device  # never quantized (a meta placeholder)

    @property
    def lm_head_holder(self) -> WeightHolder:
        """The LM head's layer: the embedding when the embeddings are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding matrix when the embeddings are tied. A quantized
        head's is a "meta" placeholder (its shape only): `dense_lm_head_weight` has values."""
        return self.lm_head_holder.weight

    def dense_lm_head_weight(self) -> torch.Tensor:
        """The LM head's values, dequantized when it is quantized (a copy then)."""
        return self.lm_head_holder.dense_weight()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input for `input_ids` (scaled embeddings where the arch scales)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden

    def compute_logits(self, hidden_after_norm: torch.Tensor) -> torch.Tensor:
        """float32 vocab logits for hidden states that already went through `final_norm`
        (soft-capped where the arch caps them)."""
        head = self.lm_head_holder
        logits = linear(hidden_after_norm, head.matrix, None, out_dtype=torch.float32,
                        activations=head.quant_activations)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, forward_batch: ForwardBatch, backend: AttentionBackend) -> CausalLMOutput:
        ropes = [self.rotary(forward_batch.positions)]
        if self.local_rotary is not None:
            ropes.append(self.local_rotary(forward_batch.positions))
        hidden = self.embed(forward_batch.input_ids)
        cos, sin = ropes[0]
        first_qkv = (cast(DecoderLayer, self.layers[0]).self_attn.qkv_proj.matrix
                     if self.all_llama_form else None)
        stacked = None
        if first_qkv is not None and _few_rows_apply(hidden, first_qkv, cos):
            stacked = self._decode_layers(hidden, cos, sin, forward_batch, backend)
        elif first_qkv is not None and _batch_rows_apply(hidden, first_qkv, cos):
            stacked = self._decode_batch(hidden, cos, sin, forward_batch, backend)
        if stacked is not None:
            hidden = stacked
        else:
            for layer, local in zip(self.layers, self.uses_local_rope, strict=True):
                cos, sin = ropes[1] if local else ropes[0]
                hidden = layer(hidden, cos, sin, forward_batch, backend)
        every_token = hidden
        if forward_batch.logits_indices is not None:
            hidden = hidden.index_select(0, forward_batch.logits_indices)
        logits = self.compute_logits(self.final_norm(hidden))
        if not forward_batch.capture_hidden:
            return CausalLMOutput(logits)
        return CausalLMOutput(logits, hidden, every_token)
