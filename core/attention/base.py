"""The attention backend protocol.

A backend is built once per engine with an `AttentionContext`. For every batch the runner
calls `init_forward_metadata(forward_batch)` once, then each attention layer calls
`forward(q, k, v, layer, forward_batch)`, which stores the new K/V at
`forward_batch.out_cache_loc` and returns attention over the paged cache as read through
`req_to_token`. A backend whose decode is the CPU paged-decode kernel may also describe a
decode layer's attention as that kernel's operands (`paged_decode_plan`); a model that can
then runs the whole layer in compiled code instead of calling `forward`. Extend-like modes (prefill, mixed, verify, draft extend) may carry a custom
mask; decode modes have one query per request (or per branch for topk>1 drafting).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.structs.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # attend to at most this many most recent tokens


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend supports, as data: checked by `registry.validate_config`.

    Given once, when the backend is registered (`register(name, loader, capabilities)`); the
    backend class carries none. Whether a backend may run page_size>1 with topk>1 is not a
    capability: `plugserve.registry.PAGE_TREE_WHITELIST` alone decides.
    """

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    page_sizes: frozenset[int] | None = None  # None = any page size
    custom_mask: bool = True  # speculative verify with a tree mask
    topk_gt1: bool = True  # topk>1 tree drafting at page_size 1
    sliding_window: bool = True
    # Runs on one tensor-parallel rank's heads (AttentionContext and AttentionLayer carry the
    # rank's head counts); tp_size > 1 is refused for a backend without it.
    tensor_parallel: bool = False
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {
            "devices": sorted(self.devices),
            "dtypes": sorted(self.dtypes),
            "page_sizes": "any" if self.page_sizes is None else sorted(self.page_sizes),
            "custom_mask": self.custom_mask,
            "topk>1": self.topk_gt1,
            "sliding_window": self.sliding_window,
            "tensor_parallel": self.tensor_parallel,
        }


@dataclass(frozen=True)
class AttentionContext:
    """Fixed facts about the engine a backend may size its buffers from. Under tensor
    parallelism the head counts are this rank's (`num_heads / tp_size`, and its KV heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_batch_size: int
    context_len: int
    dtype: torch.dtype
    device: torch.device
    spec_topk: int = 1
    # Fix toggles requested at start-up (EngineConfig.revert_fixes): a backend that owns a
    # toggle reads it here, never from the environment.
    revert_fixes: frozenset[str] = frozenset()


class AttentionBackend(ABC):
    name: ClassVar[str] = "abstract"

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-batch metadata into `forward_batch.attn_metadata` (once per batch)."""

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> same shape. KV is already stored."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] (one per request) -> same shape."""

    def paged_decode_plan(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> PagedDecodePlan | None:
        """This decode batch's attention for `layer` as the CPU paged-decode kernel's operands,
        where the backend's `forward` would store k/v and run exactly that kernel: a model
        may then run the whole layer in compiled code (`plugserve.kernels.decode_layer`)
        instead of calling `forward`. None (the default) where it would do anything else."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store k, v ([num_tokens, num_kv_heads, head_dim]) then attend with q."""
        forward_batch.kv_pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if forward_batch.mode.is_decode():
            return self.forward_decode(q, layer, forward_batch)
        return self.forward_extend(q, layer, forward_batch)
