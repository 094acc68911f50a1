"""FlashInferAttentionBackend: the engine-facing side of FlashInfer's paged wrappers.

`init_forward_metadata` builds a `FlashInferMetadata` once per batch (plain torch, see
`metadata`); each layer then runs a prefill wrapper (extend modes: causal, or the tree mask of
a verify) or a decode wrapper (one entry per query; per branch in a topk>1 draft decode) over
the NHD views `[pages, page_size, kv_heads, head_dim]` of the KV pool. A wrapper is planned
once per batch and window: layers with different sliding windows get their own wrapper (in a
tree verify the window is folded into the mask, since it counts positions).

Masked (tree-verify) prefills never share a wrapper with causal ones, and their wrapper is
made with `backend="fa2"`: FlashInfer fixes an `auto` wrapper's backend at its first plan(),
and on sm90 a causal plan picks fa3, whose kernel refuses a custom mask (fix toggle
`flashinfer_shared_prefill_wrapper` puts the shared wrapper back). plan() gets its indptr and
last-page arrays on the host, where they are built: FlashInfer reads them there (it would copy
device ones back every batch); the page ids stay on the device.

`kernels` is the namespace the wrappers come from: `flashinfer` itself (imported here only
when the backend is built for CUDA), or `plugserve_attention_flashinfer.reference`, its CPU
interpreter, which the CPU tests pass to run this very code without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from plugserve.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    cuda_device_scope,
)
from plugserve.attention.kernel_library import KernelLibraryBackend
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_attention_flashinfer.buffers import PageIndexBuffer
from plugserve_attention_flashinfer.environment import (
    INSTALL_HINT,
    PINNED_FLASHINFER,
    installed_version,
    kernels_problem,
)
from plugserve_attention_flashinfer.fixes import DRAFT_INDICES_TOPK_FACTOR, SHARED_PREFILL_WRAPPER
from plugserve_attention_flashinfer.metadata import (
    FlashInferMetadata,
    build_decode_metadata,
    build_extend_metadata,
)

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
TENSOR_CORE_GROUP = 4  # decode with tensor cores from this many query heads per KV head


def import_flashinfer() -> Any:
    """The flashinfer module, after checking this process can run it."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "attention backend 'flashinfer' requires CUDA, but torch sees no CUDA device; "
            "use --attention torch_native on this machine"
        )
    if installed_version("flashinfer-python") is None:
        raise ImportError(f"attention backend 'flashinfer' needs flashinfer-python "
                          f"{PINNED_FLASHINFER}; {INSTALL_HINT}")
    problem = kernels_problem()
    if problem is not None:
        raise RuntimeError(f"attention backend 'flashinfer': {problem}")
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            f"attention backend 'flashinfer' needs the flashinfer package ({exc}); {INSTALL_HINT}"
        ) from exc
    version = installed_version("flashinfer-python")
    if version != PINNED_FLASHINFER:
        log.warning("attention backend 'flashinfer' was checked against flashinfer-python %s; "
                    "%s is installed", PINNED_FLASHINFER, version)
    return flashinfer


def load_backend() -> type[AttentionBackend]:
    """The backend class, once CUDA and flashinfer are known to be there (the loader)."""
    import_flashinfer()
    return FlashInferAttentionBackend


class FlashInferAttentionBackend(KernelLibraryBackend):
    name = "flashinfer"
    kernel_library = "FlashInfer's"
    load_kernels = staticmethod(import_flashinfer)

    def allocate(self, ctx: AttentionContext) -> None:
        device = torch.device(ctx.device)
        topk_factor = max(1, ctx.spec_topk)
        sizing = "max_batch_size x spec_topk"
        if DRAFT_INDICES_TOPK_FACTOR in self.revert_fixes:
            topk_factor, sizing = 1, f"max_batch_size (reverted: {DRAFT_INDICES_TOPK_FACTOR})"
        self.index_buffer = PageIndexBuffer(max_lists=ctx.max_batch_size * topk_factor,
                                            device=device, sizing=sizing)
        workspace = getattr(self.kernels, "WORKSPACE_BYTES", WORKSPACE_BYTES)
        with cuda_device_scope(device):
            self._workspace = torch.zeros(workspace, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, int, float], Any] = {}
        self._planned_for: dict[tuple[str, int, float], FlashInferMetadata] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        page = self.ctx.page_size
        with cuda_device_scope(self.ctx.device):
            if fb.mode.is_decode():
                fb.attn_metadata = build_decode_metadata(fb, page, self.index_buffer)
            else:
                fb.attn_metadata = build_extend_metadata(fb, page, self.index_buffer)

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, layer, forward_batch, decode=False)

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, layer, forward_batch, decode=True)

    def _attend(
        self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, *, decode: bool
    ) -> torch.Tensor:
        meta = self._metadata(fb, decode=decode)
        with cuda_device_scope(self.ctx.device):
            wrapper = self._wrapper(meta, layer, q.dtype, fb)
            return wrapper.run(q.contiguous(), self._paged_cache(layer, fb))

    # --- helpers ----------------------------------------------------------------------------
    def _wrapper(
        self, meta: FlashInferMetadata, layer: AttentionLayer, q_dtype: torch.dtype,
        fb: ForwardBatch,
    ) -> Any:
        """The wrapper for this batch, kind and window, planned on first use in the batch."""
        window_left = _window_left(layer)
        kind = self._wrapper_kind(meta)
        key = (kind, window_left, float(layer.scaling))
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._new_wrapper(kind)
            self._wrappers[key] = wrapper
        if self._planned_for.get(key) is not meta:
            heads = (self.ctx.num_heads, self.ctx.num_kv_heads, self.ctx.head_dim, meta.page_size)
            dtypes = dict(q_data_type=q_dtype, kv_data_type=fb.kv_pool.dtype)
            if meta.is_decode:
                wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                             *heads, window_left=window_left, sm_scale=layer.scaling, **dtypes)
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

    def _wrapper_kind(self, meta: FlashInferMetadata) -> str:
        if meta.is_decode:
            return "decode"
        if meta.custom_mask is not None and SHARED_PREFILL_WRAPPER not in self.revert_fixes:
            return "prefill_masked"
        return "prefill"

    def _new_wrapper(self, kind: str) -> Any:
        if kind == "decode":
            group = self.ctx.num_heads // self.ctx.num_kv_heads
            return self.kernels.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=group >= TENSOR_CORE_GROUP)
        # fa2 is FlashInfer's prefill backend that takes a custom mask; causal prefills keep
        # `auto` (fa3 on sm90), which is never planned with one.
        backend = "fa2" if kind == "prefill_masked" else "auto"
        return self.kernels.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                backend=backend)

    def _paged_cache(
        self, layer: AttentionLayer, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """NHD views of the pool: slot s is `[s // page_size, s % page_size]`."""
        page = self.ctx.page_size
        k = fb.kv_pool.get_k(layer.layer_id)
        v = fb.kv_pool.get_v(layer.layer_id)
        return (k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]))

    def _metadata(self, fb: ForwardBatch, *, decode: bool) -> FlashInferMetadata:
        meta = self.own_metadata(fb, FlashInferMetadata, decode=decode)
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
