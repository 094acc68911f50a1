"""Target features for training a draft head: the target's pre-final-norm hidden state at
every position of full token sequences.

Sequences are packed into EXTEND forwards of at most `batch_tokens` tokens (a longer sequence
runs alone) over a private KV pool, with the reference torch_native backend, so nothing of an
engine is needed: the model object is enough.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from plugserve.attention.base import AttentionContext
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.model.llama import CausalLM
from plugserve.pools.kv_pool import KVPool
from plugserve.pools.req_to_token import ReqToTokenPool
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode


def pack_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequence indices whose lengths add up to at most `batch_tokens`
    (a sequence longer than that forms a group of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > batch_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


class _PrivateCache:
    """A page-size-1 KV pool and req_to_token table big enough for one packed batch."""

    def __init__(self, model: CausalLM, max_tokens: int, max_rows: int, max_len: int) -> None:
        arch = model.arch
        self.pool = KVPool(
            num_pages=max_tokens, page_size=1,
            layer_ids=[layer.layer_id for layer in arch.attention_layers()],
            num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            dtype=model.dtype, device=model.device, name="features",
        )
        self.rows = ReqToTokenPool(max_rows, max_len, model.device)
        self.backend = TorchNativeBackend(
            AttentionContext(
                num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim, page_size=1, max_batch_size=max_rows,
                context_len=max_len, dtype=model.dtype, device=model.device,
            )
        )

    def batch(self, sequences: Sequence[Sequence[int]], device: torch.device) -> ForwardBatch:
        """An EXTEND batch over `sequences` (no cached prefix), every token's hidden captured."""
        lens = [len(s) for s in sequences]
        next_slot = 1  # slot 0 is the padding page
        for row, n in enumerate(lens):
            self.rows.write(row, 0, torch.arange(next_slot, next_slot + n, dtype=torch.int64))
            next_slot += n

        def longs(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64, device=device)

        total = sum(lens)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=longs([t for s in sequences for t in s]),
            positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device),
            out_cache_loc=torch.arange(1, 1 + total, dtype=torch.int64, device=device),
            req_pool_indices=torch.arange(len(lens), dtype=torch.int64, device=device),
            seq_lens=longs(lens),
            extend_prefix_lens=longs([0] * len(lens)),
            extend_seq_lens=longs(lens),
            req_to_token=self.rows.req_to_token,
            kv_pool=self.pool,
            seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=[0] * len(lens),
            extend_seq_lens_cpu=list(lens),
            # logits of each sequence's last token only: the vocab-wide rows are not needed
            logits_indices=longs(list(itertools.accumulate(lens))) - 1,
            capture_hidden=True,
        )


def target_hidden_states(
    model: CausalLM, sequences: Sequence[Sequence[int]], *, batch_tokens: int = 4096
) -> list[torch.Tensor]:
    """For each sequence, the target's pre-final-norm hidden states `[len, hidden]` at every
    position (model dtype, model device; plain tensors, usable in autograd as inputs)."""
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if not sequences:
        return []
    lens = [len(s) for s in sequences]
    limit = model.arch.max_position_embeddings
    for i, n in enumerate(lens):
        if n == 0:
            raise ValueError(f"sequence {i} is empty")
        if n > limit:
            raise ValueError(
                f"sequence {i} has {n} tokens; the model handles at most {limit} positions"
            )
    vocab = model.arch.vocab_size
    bad = [t for s in sequences for t in s if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
    groups = pack_batches(lens, batch_tokens)
    cache = _PrivateCache(
        model,
        max_tokens=max(sum(lens[i] for i in g) for g in groups),
        max_rows=max(len(g) for g in groups),
        max_len=max(lens),
    )
    out: list[torch.Tensor] = []
    for group in groups:
        fb = cache.batch([sequences[i] for i in group], model.device)
        cache.backend.init_forward_metadata(fb)
        with torch.no_grad():
            result = model(fb, cache.backend)
        assert result.token_hidden_states is not None
        out.extend(h.clone() for h in result.token_hidden_states.split([lens[i] for i in group]))
    return out
