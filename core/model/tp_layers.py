"""The tensor-parallel Llama-family model: the same decoder with its weights split over ranks.

`TPCausalLM` is `CausalLM` built at one rank's shape (`ModelShard.local_arch`): q/k/v and
gate/up are column-parallel (each rank computes its heads and MLP columns; nothing to
exchange), o and down are row-parallel (`RowParallelLinear`: a partial product, then one
all-reduce), the embedding is vocabulary-parallel (each rank looks up its rows, zeros
elsewhere, one all-reduce) and so is the LM head (each rank's logits, gathered for
sampling). Norms, rope and the attention scale are replicated.

The compiled decode paths (`plugserve.kernels.decode_layer`: a layer, or the whole stack, in
one call) have no place for the all-reduces, so every layer takes the per-layer torch path.
Row-parallel partial sums are reduced in float32 and rounded to the model dtype once, as a
one-rank matmul's float32 accumulator is.
"""

from __future__ import annotations

import torch
from torch import nn

from plugserve.model.arch import ModelArchConfig
from plugserve.model.layers import Device, WeightHolder, linear
from plugserve.model.llama import CausalLM
from plugserve.model.tp_shard import ModelShard


class RowParallelLinear(WeightHolder):
    """y = x @ weight.T (+ bias) where x and weight hold this rank's slice of the input
    features: the ranks' partial products are summed (one all-reduce), then the bias (whole,
    on every rank) is added once."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
        device: Device, shard: ModelShard,
    ) -> None:
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.matrix, None, out_dtype=torch.float32,
                         activations=self.quant_activations)
        out = self.shard.all_reduce_(partial)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return (f"in={in_features} (rank {self.shard.rank} of {self.shard.size}), "
                f"out={out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(WeightHolder):
    """This rank's rows of the embedding (`shard.vocab_range`); other ids look up zeros, and
    one all-reduce gives every rank the whole embedding of every id."""

    def __init__(self, shard: ModelShard, size: int, *, dtype: torch.dtype,
                 device: Device) -> None:
        super().__init__()
        self.shard = shard
        self.start, stop = shard.vocab_range
        self.count = stop - self.start
        self.weight = nn.Parameter(
            torch.empty(shard.vocab_rows, size, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = self.lookup_rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.shard.all_reduce_(out)


class TPCausalLM(CausalLM):
    """`CausalLM` holding rank `shard.rank`'s part of every weight. `arch` stays the whole
    model's shape; `local_arch` is what this rank holds (its KV pool and attention backend
    are sized from it)."""

    def __init__(
        self, arch: ModelArchConfig, shard: ModelShard, *, dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
    ) -> None:
        local = shard.local_arch()
        super().__init__(local, dtype=dtype, device=device)
        self.arch = arch
        self.local_arch = local
        self.shard = shard
        self.embed_tokens = VocabParallelEmbedding(
            shard, arch.hidden_size, dtype=dtype, device=device)
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(
                local.q_size, arch.hidden_size, bias=arch.attention_out_bias, dtype=dtype,
                device=device, shard=shard)
            mlp.down_proj = RowParallelLinear(
                local.intermediate_size, arch.hidden_size, bias=arch.mlp_bias, dtype=dtype,
                device=device, shard=shard)
            layer.has_llama_form = False  # the compiled layer has no all-reduce in it
        self.all_llama_form = False

    def compute_logits(self, hidden_after_norm: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary on every rank: this rank's rows, gathered
        (then soft-capped where the arch caps them)."""
        head = self.lm_head_holder
        local = linear(hidden_after_norm, head.matrix, None, out_dtype=torch.float32,
                       activations=head.quant_activations)
        logits = self.shard.gather_vocab(local)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
