"""The Llama-family causal LM (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

Tokens of all requests in a batch are flattened into one [num_tokens, hidden] tensor; the
attention backend is the only part that knows which tokens belong to which request. Each
attention layer computes q, k and v with one fused projection, applies rope, and hands
q [num_tokens, num_heads, head_dim] and k/v [num_tokens, num_kv_heads, head_dim] to
`backend.forward`, which stores k/v in the cache and returns the attention output.

Parameters are allocated without initial values; a loader fills every one of them
(see `plugserve.model.weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.attention.base import AttentionBackend, AttentionLayer
from plugserve.model.arch import ModelArchConfig
from plugserve.model.layers import (
    Device,
    Embedding,
    Linear,
    RMSNorm,
    SwiGLUMLP,
    matmul_weight,
)
from plugserve.model.rope import RotaryEmbedding, apply_rope
from plugserve.runner.forward_batch import ForwardBatch


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
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_width = self.q_size + self.kv_size
        # q and k sit side by side in qkv: rotate them together as H + KVH heads.
        qk = qkv[:, :qk_width].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, self.layer, forward_batch)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, layer: AttentionLayer, dtype: torch.dtype, device: Device
    ) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = Attention(arch, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = SwiGLUMLP(
            arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias, dtype=dtype,
            device=device,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), cos, sin, forward_batch, backend
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """A Llama-family decoder with an LM head; `arch` says which variant."""

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
        self.final_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head: Linear | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(
                arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype, device=device
            )
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling,
            dtype=dtype, device=device,
        )

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding matrix when the embeddings are tied."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden_after_norm: torch.Tensor) -> torch.Tensor:
        """float32 vocab logits for hidden states that already went through `final_norm`."""
        weight = matmul_weight(self.lm_head_weight)
        return F.linear(hidden_after_norm.to(weight.dtype), weight).float()

    def forward(self, forward_batch: ForwardBatch, backend: AttentionBackend) -> CausalLMOutput:
        cos, sin = self.rotary(forward_batch.positions)
        hidden = self.embed_tokens(forward_batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, forward_batch, backend)
        every_token = hidden
        if forward_batch.logits_indices is not None:
            hidden = hidden.index_select(0, forward_batch.logits_indices)
        logits = self.compute_logits(self.final_norm(hidden))
        if not forward_batch.capture_hidden:
            return CausalLMOutput(logits)
        return CausalLMOutput(logits, hidden, every_token)
