"""ForwardBatch: everything one model forward needs, built once per batch by the runner.

Attention backends read only this object (and the KV pool it names). Tensors live on the
model's device; the `*_cpu` lists mirror the small per-request numbers so that metadata can be
built without synchronising with a GPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plugserve.mem.kv_pool import KVPool


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

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
