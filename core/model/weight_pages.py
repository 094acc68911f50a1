"""A model's CPU weights moved onto transparent huge pages, in one arena
(`plugserve.pools.huge_pages`), right after it loads.

A decode step streams every weight once; on 4 KiB pages the stream stalls at every page
(prefetcher restarts, TLB walks). A dense model's parameters are PyTorch allocations on 4 KiB
pages, a GGUF file's blocks views of its memory map, on 4 KiB pages too. Measured on a 2-core
Xeon (AVX-512, 2 threads, SmolLM2-135M, `benchmarks/roofline.py`, alternated runs): the bf16
batch-1 decode step took 9.8-10.4 ms with the weights moved against 10.9-12.1 ms without, the
float32 one 19.1-21.0 against 21.0-21.7; a Q4_1 GGUF's step moved within the noise.

`place_on_huge_pages(model)` copies every CPU parameter and every quantized weight's blocks
into one arena, in parameter order, each tensor 64-byte aligned, and points the parameters
and the weight holders at the copies. Parameters that share a storage (tied embeddings)
still share one copy; quantized parts shared by two holders too. The originals are freed
(dense tensors; glibc is asked to hand the freed heap back, `malloc_trim`, every 256 MB) or
stay only in the page cache (a GGUF file's map): the resident weight bytes do not grow, and
the copy costs ~30 ms per 100 MB at load. A GGUF's blocks are then read from the arena, no
longer from the file's map (the same bytes).

It runs once, before any kernel caches a weight (the engine calls it after loading). Nothing
moves without huge pages (`plugserve.pools.huge_pages.available`), with
`PLUGSERVE_HUGE_PAGES=0`, or for a model under one huge page (`MIN_MODEL_BYTES`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from plugserve.model.quant_weight import WeightHolder
from plugserve.pools import huge_pages
from plugserve.quant.blocks import QuantBlocks

log = logging.getLogger(__name__)

TRIM_EVERY_BYTES = 256 * 1024 * 1024  # freed heap handed back this often while copying
MIN_MODEL_BYTES = huge_pages.HUGE_PAGE_BYTES  # smaller models stay where they are


@dataclass(frozen=True)
class Placement:
    """What `place_on_huge_pages` did: bytes copied into the arena (0: nothing was moved)
    and, where /proc says, how many of them the kernel backs with huge pages."""

    arena_bytes: int
    huge_bytes: int | None
    reason: str = ""  # why nothing was moved, when nothing was


def _quant_holders(model: nn.Module) -> list[WeightHolder]:
    return [m for m in model.modules() if isinstance(m, WeightHolder) and m.quant is not None]


def _dense_params(model: nn.Module) -> dict[int, list[nn.Parameter]]:
    """The CPU parameters by the address of their storage (parameters that share one, such
    as tied embeddings, together), in parameter order."""
    by_storage: dict[int, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.device.type == "cpu" and param.numel() > 0:
            by_storage.setdefault(param.untyped_storage().data_ptr(), []).append(param)
    return by_storage


def place_on_huge_pages(model: nn.Module) -> Placement:
    """Move `model`'s CPU weights into one huge-page arena (see the module's docstring)."""
    if not huge_pages.enabled_by_environment():
        return Placement(0, None, f"{huge_pages.ENV_SWITCH}=0")
    if not huge_pages.available():
        setting = huge_pages.thp_setting()
        return Placement(0, None, f"no transparent huge pages here ({setting or 'none'})")
    dense = _dense_params(model)
    holders = _quant_holders(model)
    parts: dict[int, QuantBlocks] = {}
    for holder in holders:
        assert holder.quant is not None
        for part in holder.quant:
            parts.setdefault(id(part), part)
    padded = huge_pages.ALIGN_BYTES - 1
    total = sum(ps[0].untyped_storage().nbytes() + padded for ps in dense.values()) + sum(
        p.data.numel() + padded for p in parts.values())
    if total < MIN_MODEL_BYTES:
        return Placement(0, None, f"{total} bytes of weights: less than {MIN_MODEL_BYTES}")
    arena = huge_pages.new_arena(total)
    if arena is None:
        return Placement(0, None, "madvise(MADV_HUGEPAGE) was refused")
    target = arena.storage()
    since_trim = 0
    with torch.no_grad():
        for params in dense.values():
            storage = params[0].untyped_storage()
            offset = arena.take(storage.nbytes())
            copy = huge_pages.bytes_at(target, offset, (storage.nbytes(),))
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            since_trim += storage.nbytes()
            del storage
            for param in params:  # the same views of the copy
                old = param.data
                size = old.element_size()
                param.data = torch.empty(0, dtype=old.dtype).set_(
                    target, offset // size + old.storage_offset(), old.size(), old.stride())
            if since_trim >= TRIM_EVERY_BYTES:
                huge_pages.malloc_trim()
                since_trim = 0
        copies: dict[int, QuantBlocks] = {}
        for key, part in parts.items():
            data = part.data.contiguous()
            offset = arena.take(data.numel())
            copy = huge_pages.bytes_at(target, offset, tuple(data.shape))
            copy.copy_(data)
            copies[key] = replace(part, data=copy)
        for holder in holders:
            assert holder.quant is not None
            holder.quant = tuple(copies[id(part)] for part in holder.quant)
    huge_pages.malloc_trim()
    placement = Placement(arena.used, huge_pages.huge_bytes_at(
        arena.bytes.data_ptr(), arena.size))
    log.info("weights on huge pages: %.1f MB copied, %s", placement.arena_bytes / 1e6,
             "backing unknown" if placement.huge_bytes is None
             else f"{placement.huge_bytes / 1e6:.1f} MB backed by huge pages")
    return placement
