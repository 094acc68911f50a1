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

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from plugserve.attention.capabilities import BackendCapabilities
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.structs.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "AttentionContext", "AttentionLayer", "BackendCapabilities",
           "cuda_device_scope", "resolve_reverts"]

M = TypeVar("M")


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
    # The model's distinct sliding windows in tokens (empty: no windowed layer), for `validate`.
    sliding_windows: tuple[int, ...] = ()


def resolve_reverts(ctx: AttentionContext, explicit: Iterable[str] | None) -> frozenset[str]:
    """The fix toggles a backend honours: `explicit` when given (tests), else the engine's
    start-up choice carried by the context (`AttentionContext.revert_fixes`)."""
    return ctx.revert_fixes if explicit is None else frozenset(explicit)


def cuda_device_scope(device: torch.device | str) -> contextlib.AbstractContextManager[object]:
    """Make `device` the current CUDA device inside the block (a no-op off CUDA): kernels
    launch, and libraries allocate their scratch, on the *current* device, which nothing
    else sets when the engine runs on `cuda:N`, N != 0."""
    device = torch.device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class AttentionBackend(ABC):
    name: ClassVar[str] = "abstract"

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    @classmethod
    def validate(cls, ctx: AttentionContext) -> list[str]:
        """Every reason this backend cannot run `ctx` (empty: it can). The engine calls it at
        start-up, after the model is known and before any KV memory is allocated, and lists
        the reasons with its other start-up checks in one error. What `BackendCapabilities`
        says (devices, dtypes, page sizes, masks, windows) is checked already; this is for
        the rest: shapes the kernels take, the GPU's architecture, installed libraries.
        Override it as `super().validate(ctx) + [...]`."""
        reasons = []
        if ctx.num_kv_heads < 1 or ctx.num_heads % ctx.num_kv_heads:
            reasons.append(
                f"attention backend {cls.name!r} needs num_heads ({ctx.num_heads}) to be a "
                f"multiple of num_kv_heads ({ctx.num_kv_heads})")
        bad = [w for w in ctx.sliding_windows if w < 1]
        if bad:
            reasons.append(f"attention backend {cls.name!r}: sliding windows must be >= 1 "
                           f"token, the model has {bad}")
        return reasons

    @classmethod
    def refuse_invalid(cls, ctx: AttentionContext) -> None:
        """Raise `ValueError` listing `validate(ctx)`'s reasons (for a backend built without
        the engine's start-up check, e.g. in tests)."""
        reasons = cls.validate(ctx)
        if reasons:
            raise ValueError("; ".join(reasons))

    def own_metadata(self, forward_batch: ForwardBatch, kind: type[M], *, decode: bool) -> M:
        """`forward_batch.attn_metadata`, checked to be this backend's (`kind`, with an
        `is_decode` flag) and built for the forward asking (decode or extend)."""
        meta = forward_batch.attn_metadata
        if not isinstance(meta, kind):
            raise RuntimeError(
                f"attention backend {self.name!r} found no metadata of its own on the batch: "
                "call init_forward_metadata(forward_batch) once before the layers run")
        built_decode = bool(getattr(meta, "is_decode", decode))
        if built_decode != decode:
            built = "decode" if built_decode else "extend"
            raise RuntimeError(
                f"batch metadata was built for {built} but the {forward_batch.mode.value} "
                f"forward asked for {'decode' if decode else 'extend'}; rebuild it after "
                "changing the mode")
        return meta

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
