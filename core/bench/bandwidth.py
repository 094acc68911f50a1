"""The machine's read bandwidth and the bytes a batch-1 decode step must read: the roofline.

At batch 1 a decode step reads every weight once (a tied embedding in full, as the LM head;
an untied one only the row it looks up), so on a machine that reads B bytes/s it cannot
take less than weight bytes / B. `measure_bandwidth` is the `sum()` of a large float32
tensor (best of several; the engine's torch threads), the figure `benchmarks/roofline.py`
and `plugserve bench latency` divide by; the copy (read + write) is there for reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GB = 1e9
BANDWIDTH_MIB = 1024  # the probe's buffer: far past the last-level cache


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, after one warm-up call."""
    fn()  # warm-up (page faults, thread pool)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(mib: int | None = None, repeats: int = 5) -> dict[str, float]:
    """Read and copy bandwidth of a `mib` MiB (default BANDWIDTH_MIB) float32 buffer (GB/s,
    1e9 bytes)."""
    import torch

    from plugserve.pools.huge_pages import huge_page_buffer

    n = (mib or BANDWIDTH_MIB) * 2**20 // 4
    # On huge pages, as the engine's weights are (plugserve.pools.huge_pages): a stream over
    # 4 KiB pages read ~20% slower on the machine measured, which would flatter every figure
    # measured against it.
    src_bytes, dst_bytes = huge_page_buffer(4 * n), huge_page_buffer(4 * n)
    if src_bytes is not None and dst_bytes is not None:
        src, dst = src_bytes.view(torch.float32).fill_(1.0), dst_bytes.view(torch.float32)
    else:
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    read = best_seconds(lambda: src.sum(), repeats)
    copy = best_seconds(lambda: dst.copy_(src), repeats)
    return {
        "buffer_bytes": nbytes,
        "huge_pages": src_bytes is not None and dst_bytes is not None,
        "read_gb_s": nbytes / read / GB,
        "copy_gb_s": 2 * nbytes / copy / GB,  # read + write
    }


def weight_bytes(model: Any) -> tuple[int, bool]:
    """Bytes a decode step reads from a loaded model's weights, and whether the matmuls
    upcast to fp32 (then they read a float32 copy, counted as such). A quantized weight
    reads its blocks."""
    from plugserve.model.layers import multiplies_as_stored
    from plugserve.model.quant_weight import WeightHolder

    embed = model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    total, upcast = 0, False
    for holder in model.modules():
        if isinstance(holder, WeightHolder) and holder.quant is not None:
            rows = holder.weight.shape[0]
            held = holder.resident_bytes()
            total += held // rows if holder.weight is embed and not tied else held
    for param in model.parameters():
        if param.device.type == "meta":  # quantized: counted as its blocks above
            continue
        if param is embed and not tied:
            total += param.shape[-1] * param.element_size()  # one row looked up
            continue
        size = param.element_size()
        if param.dim() == 2 and not multiplies_as_stored(param):
            size, upcast = 4, True  # the matmul reads its float32 copy
        total += param.numel() * size
    return total, upcast


def gguf_bytes_per_token(path: Path) -> dict[str, Any]:
    """The bytes of a GGUF file's tensors one decode step reads, as stored in the file (the
    quantized roofline): every tensor, except that an untied `token_embd` is read one row.
    Also the tensor count per GGML type and the file's total tensor bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    untied = "output.weight" in names
    total = per_token = 0
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        nbytes = int(tensor.n_bytes)
        total += nbytes
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        if untied and tensor.name == "token_embd.weight":
            rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
            per_token += nbytes // max(rows, 1)
        else:
            per_token += nbytes
    return {"bytes_per_token": per_token, "tensor_bytes": total, "tensor_types": types}


def roofline_fraction(tok_per_s: float | None, bytes_per_token: int,
                      read_gb_s: float) -> float | None:
    """Decode tok/s over the bound (read bandwidth / bytes per token)."""
    if not tok_per_s or bytes_per_token <= 0 or read_gb_s <= 0:
        return None
    return tok_per_s / (read_gb_s * GB / bytes_per_token)
