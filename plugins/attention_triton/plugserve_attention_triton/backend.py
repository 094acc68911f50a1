"""TritonAttentionBackend: the engine-facing side of the Triton kernels.

`init_forward_metadata` builds a `TritonAttnMetadata` once per batch (plain torch, see
`metadata`); every layer then runs one extend kernel or the two decode kernels over it.
Building the backend prepares the Triton runtime for the engine's device (on CPU it turns the
interpreter on if `TRITON_INTERPRET` is unset), then imports the kernels; on CUDA it compiles
the kernels the model will launch (`kernels.warmup`).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from plugserve.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    cuda_device_scope,
)
from plugserve.attention.paging import decode_slot_lists
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_attention_triton.metadata import (
    TritonAttnMetadata,
    build_decode_metadata,
    build_extend_metadata,
)
from plugserve_attention_triton.runtime import prepare_triton_runtime

# Split-KV decode defaults: at most this many chunks per KV list, each at least this long.
CUDA_MAX_KV_SPLITS = 8
CUDA_MIN_TOKENS_PER_SPLIT = 256
CPU_MAX_KV_SPLITS = 2
CPU_MIN_TOKENS_PER_SPLIT = 256


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        max_kv_splits: int | None = None,
        min_tokens_per_split: int | None = None,
    ) -> None:
        super().__init__(ctx)
        self.refuse_invalid(ctx)
        self._kernels: ModuleType = prepare_triton_runtime(ctx.device)
        on_cuda = torch.device(ctx.device).type == "cuda"
        self.max_kv_splits = max_kv_splits or (CUDA_MAX_KV_SPLITS if on_cuda else CPU_MAX_KV_SPLITS)
        self.min_tokens_per_split = min_tokens_per_split or (
            CUDA_MIN_TOKENS_PER_SPLIT if on_cuda else CPU_MIN_TOKENS_PER_SPLIT
        )
        if on_cuda and not self.interpreted:
            # Compile every kernel this model can launch now rather than at its first batches.
            self._kernels.warm_up(
                num_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads, head_dim=ctx.head_dim,
                dtype=ctx.dtype, device=ctx.device, max_kv_splits=self.max_kv_splits,
            )

    @property
    def interpreted(self) -> bool:
        """Whether the kernels run in Triton's CPU interpreter in this process."""
        return bool(self._kernels.INTERPRETED)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        with cuda_device_scope(self.ctx.device):
            self._build_metadata(fb)
        pool = fb.kv_pool
        # getattr: a pool-like test double may predate the SWA translation interface.
        is_windowed = getattr(pool, "is_windowed", None)
        windowed = [i for i in getattr(pool, "layer_ids", ()) if is_windowed(i)] if (
            is_windowed is not None) else []
        meta = fb.attn_metadata
        if windowed and isinstance(meta, TritonAttnMetadata):
            # One translated copy of the KV index table (full slots -> SWA slots) serves
            # every windowed layer of the batch; it shares the decode scratch buffers.
            meta.windowed = dataclasses.replace(
                meta, kv_indices=pool.slots_for_layer(windowed[0], meta.kv_indices)
            )

    def _build_metadata(self, fb: ForwardBatch) -> None:
        if not fb.mode.is_decode():
            fb.attn_metadata = build_extend_metadata(fb)
            return
        kv_indptr_cpu, kv_indices = decode_slot_lists(fb)  # branch lists or request rows
        fb.attn_metadata = build_decode_metadata(
            kv_indptr_cpu=kv_indptr_cpu, kv_indices=kv_indices,
            max_kv_splits=self.max_kv_splits, min_tokens_per_split=self.min_tokens_per_split,
        )

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=False, layer=layer)
        k_buffer, v_buffer = self._buffers(layer, forward_batch)
        with cuda_device_scope(self.ctx.device):  # Triton launches on the current device
            return self._kernels.extend_attention(
                _rows_contiguous(q), k_buffer, v_buffer, meta,
                scaling=layer.scaling, sliding_window=_window(layer),
            )

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=True, layer=layer)
        k_buffer, v_buffer = self._buffers(layer, forward_batch)
        with cuda_device_scope(self.ctx.device):  # Triton launches on the current device
            return self._kernels.decode_attention(
                _rows_contiguous(q), k_buffer, v_buffer, meta,
                scaling=layer.scaling, sliding_window=_window(layer),
            )

    def _metadata(
        self, fb: ForwardBatch, *, decode: bool, layer: AttentionLayer | None = None
    ) -> TritonAttnMetadata:
        meta = self.own_metadata(fb, TritonAttnMetadata, decode=decode)
        if layer is not None and meta.windowed is not None and fb.kv_pool.is_windowed(
            layer.layer_id
        ):
            return meta.windowed  # a windowed layer of a hybrid pool reads translated slots
        return meta

    @staticmethod
    def _buffers(layer: AttentionLayer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        k_buffer = fb.kv_pool.get_k(layer.layer_id)
        v_buffer = fb.kv_pool.get_v(layer.layer_id)
        if k_buffer.shape[1] * (layer.num_heads // layer.num_kv_heads) != layer.num_heads:
            raise ValueError(
                f"layer {layer.layer_id}: KV pool has {k_buffer.shape[1]} KV heads but the "
                f"layer has {layer.num_heads} heads over {layer.num_kv_heads} KV heads"
            )
        return _rows_contiguous(k_buffer), _rows_contiguous(v_buffer)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension with stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _window(layer: AttentionLayer) -> int | None:
    window = layer.sliding_window
    if window is not None and window < 1:
        raise ValueError(f"layer {layer.layer_id}: sliding_window must be >= 1, got {window}")
    return window
