"""Compile, at engine start on CUDA, every kernel variant a model's batches can launch.

Triton compiles a kernel at its first launch with a new specialisation, which would stall
the first prefill, the first decode, the first split decode and the first speculative verify
each for seconds. The backend calls `warm_up` once when it is built: tiny batches of the
model's shape go through the same launchers (`extend_launch`, `decode_launches`) and Triton's
launch path with `warmup=True`, which compiles (or loads from Triton's cache) what the real
launches will use, without running anything.

What a model launches, given its dtype, head sizes and the backend's split limit:
- extend: causal, causal with a sliding window, tree mask (a window is folded into the mask);
- decode stage 1: with and without a window (split counts and list lengths do not change it);
- decode stage 2: one kernel per power-of-two split tile up to the backend's split limit.
The window kernels are warmed whether or not a layer has a window: the backend is built before
it sees a layer, and an unused kernel costs one compile at the first start only (Triton caches
it on disk). The CUDA compile check verifies that these launches compile to exactly the
kernels real batches of every variant compile to.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from plugserve_attention_triton.kernels.decode import decode_launches
from plugserve_attention_triton.kernels.extend import _extend_kernel, extend_launch
from plugserve_attention_triton.kernels.launch import KernelLaunch, kernel_arch
from plugserve_attention_triton.kernels.tiles import pow2_at_least
from plugserve_attention_triton.metadata import TritonAttnMetadata, build_decode_metadata

log = logging.getLogger(__name__)

_WINDOW = 64  # any window: its value is not specialised on


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _one_token_extend(device: torch.device, *, tree_mask: bool) -> TritonAttnMetadata:
    meta = TritonAttnMetadata(
        is_decode=False, num_queries=1, qo_indptr=_ints([0, 1], device),
        kv_indptr=_ints([0, 1], device), kv_indices=_ints([0], device),
        first_query_pos=_ints([0], device), queries_per_segment_cpu=[1], kv_lens_cpu=[1],
        first_query_pos_cpu=[0],
    )
    if tree_mask:
        meta.mask_indptr = _ints([0], device)
        meta.custom_mask = torch.ones(1, dtype=torch.uint8, device=device)
    return meta


def model_launches(
    *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, arch: int | None, max_kv_splits: int,
) -> list[KernelLaunch]:
    """One launch per distinct kernel a model of this shape can launch on `arch`."""
    max_splits = max(1, max_kv_splits)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(max_splits, num_kv_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    common = dict(scaling=head_dim**-0.5, arch=arch)
    launches = [
        extend_launch(q, kv, kv, out, _one_token_extend(device, tree_mask=tree),
                      sliding_window=window, **common)
        for tree, window in ((False, None), (False, _WINDOW), (True, None))
    ]
    # Stage 1 does not depend on the split count; stage 2's split tile does.
    reduce_tiles = sorted({pow2_at_least(s, 2) for s in range(1, max_splits + 1)})
    for tile in reduce_tiles:
        splits = min(tile, max_splits)  # a list of `splits` keys, one key per split
        meta = build_decode_metadata(
            kv_indptr_cpu=[0, splits], max_kv_splits=splits, min_tokens_per_split=1,
            kv_indices=torch.zeros(splits, dtype=torch.int64, device=device))
        partial, reduce = decode_launches(q, kv, kv, out, meta, sliding_window=None, **common)
        if tile == reduce_tiles[0]:
            windowed, _ = decode_launches(q, kv, kv, out, meta, sliding_window=_WINDOW,
                                          **common)
            launches += [partial, windowed]
        launches.append(reduce)
    return launches


def warm_up(
    *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, max_kv_splits: int,
) -> int:
    """Compile the model's kernels for `device` (CUDA, compiled kernels); returns how many.
    Compiles run side by side (Triton's async compile mode): ptxas runs in its own
    processes."""
    device = torch.device(device)
    arch = kernel_arch(_extend_kernel, device)
    if arch is None:
        return 0
    begin = time.perf_counter()
    with torch.cuda.device(device):
        launches = model_launches(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, dtype=dtype, device=device, arch=arch,
                                  max_kv_splits=max_kv_splits)
        workers = max(1, min(len(launches), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool, triton.AsyncCompileMode(pool):
            for launch in launches:
                launch.compile()
    log.info("attention backend 'triton': %d kernels ready for sm_%d %s head_dim %d in %.1f s",
             len(launches), arch, str(dtype).removeprefix("torch."), head_dim,
             time.perf_counter() - begin)
    return len(launches)
