"""FlashInferAttentionBackend: the engine-facing side of FlashInfer's paged wrappers.

`init_forward_metadata` builds a `FlashInferMetadata` once per batch (plain torch, see
`metadata`); each layer then runs a prefill wrapper (extend modes: causal, or the tree mask of
a verify) or a decode wrapper (one entry per query; per branch in a topk>1 draft decode) over
the NHD views `[pages, page_size, kv_heads, head_dim]` of the KV pool. A wrapper is planned
once per batch and window: layers with different sliding windows get their own wrapper (in a
tree verify the window is folded into the mask, since it counts positions; `tree_window`).

`kernels` is the namespace the wrappers come from: `flashinfer` itself (imported here only
when the backend is built for CUDA), or `plugserve_attention_flashinfer.reference`, its CPU
interpreter, which the CPU tests pass to run this very code without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from plugserve.attention.base import AttentionBackend, AttentionContext, AttentionLayer
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_attention_flashinfer.buffers import PageIndexBuffer
from plugserve_attention_flashinfer.fixes import DRAFT_INDICES_TOPK_FACTOR, resolve_reverts
from plugserve_attention_flashinfer.metadata import (
    FlashInferMetadata,
    build_decode_metadata,
    build_extend_metadata,
)

INSTALL_HINT = "pip install 'plugserve-attention-flashinfer[cuda]'"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
TENSOR_CORE_GROUP = 4  # decode with tensor cores from this many query heads per KV head


def import_flashinfer() -> Any:
    """The flashinfer module, after checking this process can run it."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "attention backend 'flashinfer' requires CUDA, but torch sees no CUDA device; "
            "use --attention torch_native on this machine"
        )
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            f"attention backend 'flashinfer' needs the flashinfer package ({exc}); {INSTALL_HINT}"
        ) from exc
    return flashinfer


def load_backend() -> type[AttentionBackend]:
    """The backend class, once CUDA and flashinfer are known to be there (the loader)."""
    import_flashinfer()
    return FlashInferAttentionBackend


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        kernels: Any | None = None,
        revert_fixes: Iterable[str] | None = None,
    ) -> None:
        super().__init__(ctx)
        if ctx.num_kv_heads < 1 or ctx.num_heads % ctx.num_kv_heads != 0:
            raise ValueError(
                f"attention backend 'flashinfer' needs num_heads ({ctx.num_heads}) to be a "
                f"multiple of num_kv_heads ({ctx.num_kv_heads})"
            )
        if kernels is None:
            if torch.device(ctx.device).type != "cuda":
                raise RuntimeError(
                    f"attention backend 'flashinfer' runs FlashInfer's CUDA kernels; device "
                    f"{str(ctx.device)!r} is not CUDA (use --attention torch_native)"
                )
            kernels = import_flashinfer()
        self.kernels = kernels
        self.revert_fixes = resolve_reverts(ctx, revert_fixes)
        device = torch.device(ctx.device)
        topk_factor = max(1, ctx.spec_topk)
        sizing = "max_batch_size x spec_topk"
        if DRAFT_INDICES_TOPK_FACTOR in self.revert_fixes:
            topk_factor, sizing = 1, f"max_batch_size (reverted: {DRAFT_INDICES_TOPK_FACTOR})"
        self.index_buffer = PageIndexBuffer(max_lists=ctx.max_batch_size * topk_factor,
                                            device=device, sizing=sizing)
        workspace = getattr(kernels, "WORKSPACE_BYTES", WORKSPACE_BYTES)
        self._workspace = torch.zeros(workspace, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, int, float], Any] = {}
        self._planned_for: dict[tuple[str, int, float], FlashInferMetadata] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        page = self.ctx.page_size
        if fb.mode.is_decode():
            fb.attn_metadata = build_decode_metadata(fb, page, self.index_buffer)
        else:
            fb.attn_metadata = build_extend_metadata(fb, page, self.index_buffer)

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=False)
        wrapper = self._wrapper(meta, layer, q.dtype, forward_batch)
        return wrapper.run(q.contiguous(), self._paged_cache(layer, forward_batch))

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=True)
        wrapper = self._wrapper(meta, layer, q.dtype, forward_batch)
        return wrapper.run(q.contiguous(), self._paged_cache(layer, forward_batch))

    # --- helpers ----------------------------------------------------------------------------
    def _wrapper(
        self, meta: FlashInferMetadata, layer: AttentionLayer, q_dtype: torch.dtype,
        fb: ForwardBatch,
    ) -> Any:
        """The wrapper for this batch, kind and window, planned on first use in the batch."""
        window_left = _window_left(layer)
        key = ("decode" if meta.is_decode else "prefill", window_left, float(layer.scaling))
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._new_wrapper(meta.is_decode)
            self._wrappers[key] = wrapper
        if self._planned_for.get(key) is not meta:
            heads = (self.ctx.num_heads, self.ctx.num_kv_heads, self.ctx.head_dim, meta.page_size)
            dtypes = dict(q_data_type=q_dtype, kv_data_type=fb.kv_pool.dtype)
            if meta.is_decode:
                wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, *heads,
                             window_left=window_left, sm_scale=layer.scaling, **dtypes)
            else:
                assert meta.qo_indptr is not None
                mask = meta.mask_for_window(layer.sliding_window)
                wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                             meta.kv_last_page_len, *heads, custom_mask=mask,
                             causal=mask is None, sm_scale=layer.scaling,
                             # a tree's window is in its mask (positions, not rows)
                             window_left=window_left if mask is None else -1, **dtypes)
            self._planned_for[key] = meta
        return wrapper

    def _new_wrapper(self, decode: bool) -> Any:
        if decode:
            group = self.ctx.num_heads // self.ctx.num_kv_heads
            return self.kernels.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=group >= TENSOR_CORE_GROUP)
        return self.kernels.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def _paged_cache(
        self, layer: AttentionLayer, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """NHD views of the pool: slot s is `[s // page_size, s % page_size]`."""
        page = self.ctx.page_size
        k = fb.kv_pool.get_k(layer.layer_id)
        v = fb.kv_pool.get_v(layer.layer_id)
        return (k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]))

    def _metadata(self, fb: ForwardBatch, *, decode: bool) -> FlashInferMetadata:
        meta = fb.attn_metadata
        if not isinstance(meta, FlashInferMetadata):
            raise RuntimeError(
                "attention backend 'flashinfer' found no metadata of its own on the batch: "
                "call init_forward_metadata(forward_batch) once before the layers run"
            )
        if meta.is_decode != decode:
            built = "decode" if meta.is_decode else "extend"
            raise RuntimeError(f"batch metadata was built for {built} but the {fb.mode.value} "
                               "forward asked for the other; rebuild it after changing the mode")
        if meta.buffer_generation != self.index_buffer.generation:
            raise RuntimeError(
                "attention backend 'flashinfer': this batch's page ids were overwritten by a "
                "later init_forward_metadata (the kv_indices buffer is shared); run a batch's "
                "layers before building the next batch's metadata"
            )
        return meta


def _window_left(layer: AttentionLayer) -> int:
    """FlashInfer's inclusive left window: a window of w tokens keeps positions >= q - (w-1)."""
    window = layer.sliding_window
    if window is None:
        return -1
    if window < 1:
        raise ValueError(f"layer {layer.layer_id}: sliding_window must be >= 1, got {window}")
    return window - 1
