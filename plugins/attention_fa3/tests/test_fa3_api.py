"""Every call the backend makes to FA3's `flash_attn_with_kvcache`, bound against the pinned
sgl-kernel's real signature (read from its wheel's `sgl_kernel/flash_attn.py` with `ast`:
downloaded once, cached; skipped with the reason when it cannot be fetched), with the dtypes
and layouts it documents: int32 page table `[batch, max_pages]`, int32 `cache_seqlens` and
`cu_seqlens_q`, paged K/V `[num_blocks, page_block_size, kv_heads, head_dim]`, varlen q."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from plugserve.testing.api_check import Recorder, signature_in
from plugserve.testing.paged_cases import Cases, Shape, run_backend
from plugserve_attention_fa3 import reference
from plugserve_attention_fa3.backend import FA3AttentionBackend


def test_every_call_binds_to_the_real_signature(
    sgl_kernel_file: Callable[[str], Path], cases: Cases
) -> None:
    signature = signature_in(sgl_kernel_file("flash_attn.py").read_text(),
                             "flash_attn_with_kvcache")
    recorder = Recorder()
    kernels = SimpleNamespace(flash_attn_with_kvcache=recorder.wrap(
        "flash_attn_with_kvcache", reference.flash_attn_with_kvcache))
    shape = Shape(16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  sliding_window=24)
    backend = FA3AttentionBackend(shape.context(cases.device), kernels=kernels)
    for fb in (cases.extend(shape, [0, 19], [21, 5]),
               cases.extend(shape, [7, 30], [6, 4], tree_mask=True),
               cases.decode(shape, [9, 40])):
        q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        run_backend(backend, fb, q, shape)
    assert recorder.calls
    for call in recorder.calls:
        args = signature.bind(*call.args, **call.kwargs).arguments
        q, k_cache, v_cache = args["q"], args["k_cache"], args["v_cache"]
        assert q.dim() == 3 and q.is_contiguous() and q.dtype == k_cache.dtype
        assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
        assert k_cache.shape[2:] == (shape.num_kv_heads, shape.head_dim)
        for name in ("cache_seqlens", "cu_seqlens_q"):
            assert args[name].dtype == torch.int32, name
        table = args["page_table"]
        assert table.dtype == torch.int32 and table.dim() == 2
        assert args["cu_seqlens_q"].numel() == table.shape[0] + 1
        assert isinstance(args["max_seqlen_q"], int)
        left, right = args["window_size"]
        assert isinstance(left, int) and isinstance(right, int)
