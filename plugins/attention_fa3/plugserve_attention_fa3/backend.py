"""FA3AttentionBackend: the engine-facing side of FA3's `flash_attn_with_kvcache`.

`init_forward_metadata` builds an `Fa3Metadata` once per batch (plain torch, see `metadata`);
each layer then makes one call over the pool viewed as `[pages, page_size, kv_heads,
head_dim]` (prefill, decode, topk>1 draft decode), or for a tree verify two calls (the cached
prefix by pages, the tree tokens through a page-size-1 view) merged by their log-sum-exps.
Sliding windows are FA3's `window_size`, except in a tree verify, where a window counts token
positions: a windowed layer there makes one call over each token's windowed keys by slots.

`kernels` is the namespace `flash_attn_with_kvcache` comes from: an FA3 build
(`flash_attn_interface` from flash-attention's hopper/ directory, or `sgl_kernel.flash_attn`),
imported here only when the backend is built for CUDA, or
`plugserve_attention_fa3.reference`, its CPU interpreter, which the CPU tests pass to run
this very code without a GPU.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
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
from plugserve_attention_fa3.environment import INSTALL_HINT, fa3_problem
from plugserve_attention_fa3.fixes import DRAFT_PAGE_SCATTER
from plugserve_attention_fa3.merge import merge_partial_attention
from plugserve_attention_fa3.metadata import (
    Fa3Call,
    Fa3Metadata,
    build_decode_metadata,
    build_extend_metadata,
)
from plugserve_attention_fa3.page_table import PageTableBuffer

FA3_MODULES = ("flash_attn_interface", "sgl_kernel.flash_attn")
MAX_HEAD_DIM = 256
FA3_SM_MAJORS = (8, 9)  # sgl-kernel's is_fa3_supported: compute capability 8.x or 9.x


def import_fa3() -> Any:
    """A namespace with FA3's `flash_attn_with_kvcache`, after checking CUDA is there."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "attention backend 'fa3' requires CUDA, but torch sees no CUDA device; "
            "use --attention torch_native on this machine"
        )
    problem = fa3_problem()  # e.g. an sgl-kernel built for another torch: refuse, name why
    if problem is not None:
        raise ImportError(f"attention backend 'fa3': {problem}")
    failures = []
    for name in FA3_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        return SimpleNamespace(flash_attn_with_kvcache=module.flash_attn_with_kvcache,
                               source=name)
    raise ImportError(
        f"attention backend 'fa3' needs FlashAttention 3 ({'; '.join(failures)}); {INSTALL_HINT}"
    )


def load_backend() -> type[AttentionBackend]:
    """The backend class, once CUDA and an FA3 build are known to be there (the loader)."""
    import_fa3()
    return FA3AttentionBackend


class FA3AttentionBackend(KernelLibraryBackend):
    name = "fa3"
    kernel_library = "FA3's"
    load_kernels = staticmethod(import_fa3)

    def allocate(self, ctx: AttentionContext) -> None:
        self.page_table = PageTableBuffer(
            max_rows=ctx.max_batch_size * max(1, ctx.spec_topk), device=torch.device(ctx.device))

    @classmethod
    def validate(cls, ctx: AttentionContext) -> list[str]:
        reasons = super().validate(ctx)
        if ctx.head_dim > MAX_HEAD_DIM or ctx.head_dim % 8:
            reasons.append(f"attention backend 'fa3' needs head_dim <= {MAX_HEAD_DIM} and a "
                           f"multiple of 8 (FA3's kernels); the model has {ctx.head_dim}")
        device = torch.device(ctx.device)
        if device.type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            if major not in FA3_SM_MAJORS:
                reasons.append(f"attention backend 'fa3' runs on sm80/sm86/sm89/sm90 GPUs "
                               f"(sgl-kernel's is_fa3_supported); {device} is sm{major}{minor}")
        return reasons

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        page = self.ctx.page_size
        with cuda_device_scope(self.ctx.device):
            if fb.mode.is_decode():
                fb.attn_metadata = build_decode_metadata(
                    fb, page, self.page_table,
                    distinct_pages=DRAFT_PAGE_SCATTER in self.revert_fixes)
            else:
                fb.attn_metadata = build_extend_metadata(fb, page, self.page_table)

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=False)
        q = q.contiguous()
        window = _window(layer)
        if meta.tree is None:
            return self._run(q, meta.main, layer, forward_batch, _causal_window(window))
        if window is not None:  # one call over each token's windowed keys, by slots
            return self._run(q, meta.windowed_verify(window), layer, forward_batch, (-1, -1))
        # Tree verify: the prefix (not causal) and the tree tokens, merged by their LSEs.
        out_prefix, lse_prefix = self._run(q, meta.main, layer, forward_batch, (-1, -1),
                                           lse=True)
        out_tree, lse_tree = self._run(q, meta.tree, layer, forward_batch, (-1, -1), lse=True)
        return merge_partial_attention(out_prefix, lse_prefix, meta.main.has_keys,
                                       out_tree, lse_tree, meta.tree.has_keys)

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(forward_batch, decode=True)
        return self._run(q.contiguous(), meta.main, layer, forward_batch,
                         _causal_window(_window(layer)))

    # --- helpers ----------------------------------------------------------------------------
    def _run(
        self, q: torch.Tensor, call: Fa3Call, layer: AttentionLayer, fb: ForwardBatch,
        window: tuple[int, int], *, lse: bool = False,
    ) -> Any:
        k = fb.kv_pool.get_k(layer.layer_id)
        v = fb.kv_pool.get_v(layer.layer_id)
        page = call.page_size
        with cuda_device_scope(self.ctx.device):
            result = self.kernels.flash_attn_with_kvcache(
                q, k.view(-1, page, *k.shape[1:]), v.view(-1, page, *v.shape[1:]),
                cache_seqlens=call.cache_seqlens, page_table=call.page_table,
                cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q,
                softmax_scale=layer.scaling, causal=call.causal, window_size=window,
                return_softmax_lse=lse,
            )
        if lse:
            return result[0], result[1]
        return result

    def _metadata(self, fb: ForwardBatch, *, decode: bool) -> Fa3Metadata:
        meta = self.own_metadata(fb, Fa3Metadata, decode=decode)
        if meta.table_generation != self.page_table.generation:
            raise RuntimeError(
                "attention backend 'fa3': this batch's page table was overwritten by a later "
                "init_forward_metadata (the page-table buffer is shared); run a batch's "
                "layers before building the next batch's metadata"
            )
        return meta


def _window(layer: AttentionLayer) -> int | None:
    window = layer.sliding_window
    if window is not None and window < 1:
        raise ValueError(f"layer {layer.layer_id}: sliding_window must be >= 1, got {window}")
    return window


def _causal_window(window: int | None) -> tuple[int, int]:
    """FA3's (left, right) for a causal call: a window of w tokens keeps q - (w-1) .. q."""
    return (-1, -1) if window is None else (window - 1, 0)
