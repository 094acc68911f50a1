"""ForwardBatch: everything one model forward needs, built once per batch by the runner.

Attention backends read only this object (and the KV pool it names). Tensors live on the
model's device; the `*_cpu` lists mirror the small per-request numbers so that metadata can be
built without synchronising with a GPU.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plugserve.pools.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill / mixed (decode requests extend by one token)
    DECODE = "decode"  # exactly one new token per request
    TARGET_VERIFY = "target_verify"  # speculative verify: a draft tree per request, custom mask
    DRAFT_EXTEND = "draft_extend"  # draft model catching up on accepted tokens
    DRAFT_DECODE = "draft_decode"  # one draft step; topk>1 gives topk queries per request

    def is_decode(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE)

    def is_extend(self) -> bool:
        return not self.is_decode()


@dataclass(eq=False)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, rope positions
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token writes
    req_pool_indices: torch.Tensor  # [batch] int64, row in req_to_token
    seq_lens: torch.Tensor  # [batch] int64, KV tokens each request attends to after this forward
    extend_prefix_lens: torch.Tensor  # [batch] int64, KV tokens already cached before this forward
    extend_seq_lens: torch.Tensor  # [batch] int64, new tokens per request
    req_to_token: torch.Tensor  # the pool's [rows, row_width] table
    kv_pool: KVPool
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # Speculative verify / draft: flattened bool masks, per request [extend_len, seq_len]
    # row-major, concatenated in batch order. True = may attend. None = causal.
    custom_mask: torch.Tensor | None = None
    # Rows of hidden states to return for sampling: index of each request's last new token
    # (None = every token, used by verify).
    logits_indices: torch.Tensor | None = None
    capture_hidden: bool = False
    attn_metadata: Any = None
    spec_info: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_lengths(
        cls,
        mode: ForwardMode,
        *,
        input_ids: torch.Tensor | Sequence[int],
        positions: torch.Tensor | Sequence[int],
        out_cache_loc: torch.Tensor | Sequence[int],
        req_pool_indices: torch.Tensor,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        device: torch.device | str,
        **optional: Any,
    ) -> ForwardBatch:
        """A batch laid out from per-request KV lengths: each request has `prefix_lens[i]`
        tokens cached and `extend_lens[i]` new ones; `seq_lens` and the host mirrors follow."""
        prefix = list(prefix_lens)
        extend = list(extend_lens)
        seq_lens = [p + e for p, e in zip(prefix, extend, strict=True)]
        lists = (input_ids, positions, out_cache_loc, seq_lens, prefix, extend)
        tensors: Sequence[torch.Tensor]
        if torch.device(device).type == "cpu" and all(isinstance(v, list) for v in lists):
            # One tensor for the six host lists, viewed in parts: one allocation per step.
            joined = [x for values in lists for x in values]
            whole = torch.tensor(joined, dtype=torch.int64)
            tensors = whole.split([len(values) for values in lists])
        else:
            tensors = [torch.as_tensor(v, dtype=torch.int64).to(device) for v in lists]

        return cls(
            mode=mode,
            input_ids=tensors[0],
            positions=tensors[1],
            out_cache_loc=tensors[2],
            req_pool_indices=req_pool_indices.to(device),
            seq_lens=tensors[3],
            extend_prefix_lens=tensors[4],
            extend_seq_lens=tensors[5],
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=extend,
            **optional,
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
