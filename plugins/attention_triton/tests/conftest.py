"""Fixtures for the Triton backend's tests: hand-built paged caches and ForwardBatches.

Without CUDA the kernels run in Triton's CPU interpreter, which must be switched on before
the kernel modules are imported; we do it here, first thing. With CUDA (and no explicit
TRITON_INTERPRET) the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_PLUGIN_ROOT = Path(__file__).resolve().parents[1]
if str(_PLUGIN_ROOT) not in sys.path:  # run from a checkout without installing the plugin
    sys.path.insert(0, str(_PLUGIN_ROOT))

import pytest  # noqa: E402

from plugserve.attention.base import AttentionContext, AttentionLayer  # noqa: E402
from plugserve.attention.draft_kv import (  # noqa: E402
    build_draft_kv_lists,
    holey_branch_positions,
)
from plugserve.attention.torch_native import TorchNativeBackend  # noqa: E402
from plugserve.mem.kv_pool import KVPool  # noqa: E402
from plugserve.runner.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plugserve.spec.layout import HoleyLayout  # noqa: E402
from plugserve_attention_triton.backend import TritonAttentionBackend  # noqa: E402
from plugserve_attention_triton.runtime import interpreter_requested  # noqa: E402

INTERPRETED = interpreter_requested()
KERNEL_DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")
LAYER_ID = 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    compiled_gpu = torch.cuda.is_available() and not INTERPRETED
    skip = pytest.mark.skip(reason="needs CUDA with compiled Triton kernels (TRITON_INTERPRET off)")
    for item in items:
        if "gpu" in item.keywords and not compiled_gpu and "attention_triton" in str(item.path):
            item.add_marker(skip)


@dataclass
class PagedCache:
    """A KV pool with random contents and a req_to_token table whose pages are shuffled."""

    pool: KVPool
    req_to_token: torch.Tensor
    rows: torch.Tensor  # [batch] row of each request
    page_size: int
    generator: torch.Generator
    _free_pages: list[int]

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def take_page(self) -> int:
        return self._free_pages.pop()

    def map_positions(self, request: int, positions: range) -> None:
        """Give positions of a request's row real slots, one fresh random page per row page."""
        first_page = positions.start // self.page_size
        last_page = (positions.stop - 1) // self.page_size
        pages = torch.tensor([self.take_page() for _ in range(first_page, last_page + 1)])
        pos = torch.arange(positions.start, positions.stop)
        slots = pages[pos // self.page_size - first_page] * self.page_size + pos % self.page_size
        self.req_to_token[int(self.rows[request]), pos.to(self.device)] = slots.to(self.device)

    def slots(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        return self.req_to_token[int(self.rows[request]), positions.to(self.device)]


class BatchFactory:
    """Builds paged caches, ForwardBatches and backends for one test."""

    def __init__(self, *, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(dtype=dtype, device=self.device)

    def cache(
        self,
        *,
        batch: int,
        row_width: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> PagedCache:
        pool = KVPool(num_pages=num_pages, page_size=page_size, layer_ids=[LAYER_ID],
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                      device=self.device)
        shape = pool.k_buffer[LAYER_ID].shape
        pool.k_buffer[LAYER_ID].copy_(self.randn(*shape, dtype=dtype))
        pool.v_buffer[LAYER_ID].copy_(self.randn(*shape, dtype=dtype))
        num_rows = batch + 3
        # Unused entries hold real but wrong slots: reading past a list shows up as an error.
        req_to_token = torch.randint(page_size, (num_pages + 1) * page_size,
                                     (num_rows, row_width), generator=self.generator)
        rows = torch.randperm(num_rows, generator=self.generator)[:batch]
        pages = (torch.randperm(num_pages, generator=self.generator) + 1).tolist()
        return PagedCache(pool, req_to_token.to(self.device), rows.to(self.device), page_size,
                          self.generator, pages)

    def extend_batch(
        self,
        *,
        prefix_lens: list[int],
        extend_lens: list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        tree_mask: bool = False,
        mode: ForwardMode = ForwardMode.EXTEND,
    ) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        pages_needed = sum(-(-n // page_size) for n in seq_lens)
        cache = self.cache(batch=len(seq_lens), row_width=max(seq_lens) + page_size,
                           num_pages=pages_needed + 2, page_size=page_size,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        for i, n in enumerate(seq_lens):
            cache.map_positions(i, range(n))
        out_loc = torch.cat([
            cache.slots(i, torch.arange(p, p + e)) for i, (p, e) in
            enumerate(zip(prefix_lens, extend_lens, strict=True))
        ])
        positions = torch.cat([torch.arange(p, p + e) for p, e in
                               zip(prefix_lens, extend_lens, strict=True)])
        mask = self.tree_masks(prefix_lens, extend_lens) if tree_mask else None
        return self._batch(mode, cache, positions, out_loc, seq_lens, prefix_lens, extend_lens,
                           mask)

    def tree_masks(self, prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """Flattened masks of random draft trees: node j sees the prefix and its ancestors."""
        blocks = []
        for prefix, count in zip(prefix_lens, extend_lens, strict=True):
            mask = torch.zeros(count, prefix + count, dtype=torch.bool)
            mask[:, :prefix] = True
            parents = [-1] + [int(torch.randint(0, j, (1,), generator=self.generator))
                              for j in range(1, count)]
            for node in range(count):
                walk = node
                while walk >= 0:
                    mask[node, prefix + walk] = True
                    walk = parents[walk]
            blocks.append(mask.reshape(-1))
        return torch.cat(blocks).to(self.device)

    def decode_batch(
        self, *, seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> ForwardBatch:
        pages_needed = sum(-(-n // page_size) for n in seq_lens)
        cache = self.cache(batch=len(seq_lens), row_width=max(seq_lens) + page_size,
                           num_pages=pages_needed + 2, page_size=page_size,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        for i, n in enumerate(seq_lens):
            cache.map_positions(i, range(n))
        out_loc = torch.cat([cache.slots(i, torch.tensor([n - 1])) for i, n in enumerate(seq_lens)])
        positions = torch.tensor([n - 1 for n in seq_lens])
        return self._batch(ForwardMode.DECODE, cache, positions, out_loc, seq_lens,
                           [n - 1 for n in seq_lens], [1] * len(seq_lens), None)

    def draft_decode_batch(
        self, *, prefix_lens: list[int], topk: int, step: int, num_steps: int, page_size: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """A DRAFT_DECODE batch in the holey layout of DESIGN.md §5, with per-branch lists.

        Returns the batch and the `[batch, topk, step + 1]` row positions of the branch paths.
        Every branch's first page gets a copy of the prefix's tail KV, as the spec plugin does.
        """
        layout = HoleyLayout(page_size, num_steps, topk)
        footprints = [layout.footprint(p) for p in prefix_lens]
        pages_needed = sum(-(-n // page_size) for n in footprints)
        cache = self.cache(batch=len(prefix_lens), row_width=max(footprints) + page_size,
                           num_pages=pages_needed + 2, page_size=page_size,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        for i, n in enumerate(footprints):
            cache.map_positions(i, range(n))
        paths = holey_branch_positions(prefix_lens, topk=topk, step=step, num_steps=num_steps,
                                       page_size=page_size)
        for i, prefix in enumerate(prefix_lens):
            base = layout.base(prefix)
            tail = torch.arange(base, prefix)
            for start in layout.branch_starts(prefix)[1:]:
                copy_to = cache.slots(i, tail - base + start)
                cache.pool.copy_slots(copy_to, cache.slots(i, tail))
        lists = build_draft_kv_lists(cache.req_to_token, cache.rows, prefix_lens, paths)
        out_loc = torch.cat([cache.slots(i, paths[i, :, -1]) for i in range(len(prefix_lens))])
        positions = torch.tensor([p + step for p in prefix_lens for _ in range(topk)])
        fb = self._batch(ForwardMode.DRAFT_DECODE, cache, positions, out_loc, prefix_lens,
                         prefix_lens, [0] * len(prefix_lens), None)
        lists.store(fb)
        return fb, paths

    def _batch(
        self, mode: ForwardMode, cache: PagedCache, positions: torch.Tensor,
        out_loc: torch.Tensor, seq_lens: list[int], prefix_lens: list[int],
        extend_lens: list[int], custom_mask: torch.Tensor | None,
    ) -> ForwardBatch:
        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            mode=mode,
            input_ids=torch.zeros(positions.numel(), dtype=torch.int64, device=self.device),
            positions=positions.to(self.device),
            out_cache_loc=out_loc.to(self.device),
            req_pool_indices=cache.rows,
            seq_lens=ints(seq_lens),
            extend_prefix_lens=ints(prefix_lens),
            extend_seq_lens=ints(extend_lens),
            req_to_token=cache.req_to_token,
            kv_pool=cache.pool,
            seq_lens_cpu=list(seq_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
            custom_mask=custom_mask,
        )

    def layer(self, *, num_heads: int, num_kv_heads: int, head_dim: int,
              sliding_window: int | None = None) -> AttentionLayer:
        return AttentionLayer(layer_id=LAYER_ID, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, scaling=head_dim**-0.5,
                              sliding_window=sliding_window)

    def context(self, layer: AttentionLayer, page_size: int, dtype: torch.dtype,
                spec_topk: int = 1) -> AttentionContext:
        return AttentionContext(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                                head_dim=layer.head_dim, page_size=page_size, max_batch_size=8,
                                context_len=256, dtype=dtype, device=self.device,
                                spec_topk=spec_topk)

    def backends(
        self, layer: AttentionLayer, page_size: int, dtype: torch.dtype, **triton_kwargs: int
    ) -> tuple[TritonAttentionBackend, TorchNativeBackend]:
        ctx = self.context(layer, page_size, dtype)
        return TritonAttentionBackend(ctx, **triton_kwargs), TorchNativeBackend(ctx)


def fp32_twin(fb: ForwardBatch) -> ForwardBatch:
    """The same batch over an fp32 copy of its KV pool (an exact oracle for half dtypes)."""
    pool = fb.kv_pool
    if pool.dtype == torch.float32:
        return fb
    twin = KVPool(num_pages=pool.num_pages, page_size=pool.page_size, layer_ids=pool.layer_ids,
                  num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=torch.float32,
                  device=pool.device)
    for layer_id in pool.layer_ids:
        twin.k_buffer[layer_id].copy_(pool.k_buffer[layer_id])
        twin.v_buffer[layer_id].copy_(pool.v_buffer[layer_id])
    return replace(fb, kv_pool=twin, attn_metadata=None, extra=dict(fb.extra))


def run_both(
    fb: ForwardBatch, q: torch.Tensor, layer: AttentionLayer,
    triton_backend: TritonAttentionBackend, native: TorchNativeBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch_native output) of the same batch; metadata built by each.

    torch_native runs in fp32 on an fp32 copy of the cache, so half-precision runs are
    compared with the exact answer rather than with another rounded one.
    """
    triton_backend.init_forward_metadata(fb)
    if fb.mode.is_decode():
        got = triton_backend.forward_decode(q, layer, fb)
    else:
        got = triton_backend.forward_extend(q, layer, fb)
    twin = fp32_twin(fb)
    native.init_forward_metadata(twin)
    if fb.mode.is_decode():
        want = native.forward_decode(q.float(), layer, twin)
    else:
        want = native.forward_extend(q.float(), layer, twin)
    return got, want


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error against an fp32 oracle: fp32 exact to 1e-5; half types about 1 ulp."""
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.fixture
def kernel_device() -> torch.device:
    """Where the kernels run in this process: cuda when compiled, else cpu (interpreter)."""
    return KERNEL_DEVICE


@pytest.fixture
def factory(request: pytest.FixtureRequest) -> Iterator[BatchFactory]:
    seed = sum(map(ord, request.node.name)) % 10_000
    yield BatchFactory(device=KERNEL_DEVICE, seed=seed)


@pytest.fixture
def gpu_factory(request: pytest.FixtureRequest) -> Iterator[BatchFactory]:
    seed = sum(map(ord, request.node.name)) % 10_000
    yield BatchFactory(device=torch.device("cuda"), seed=seed)


@pytest.fixture
def compare() -> object:
    """`compare(fb, q, layer, triton_backend, native)` -> (triton output, reference output)."""
    return run_both


@pytest.fixture
def upcast() -> object:
    """`upcast(fb)`: the batch over an fp32 copy of its KV pool."""
    return fp32_twin


@pytest.fixture
def tol() -> object:
    """`tol(dtype)`: the max abs error allowed against the reference."""
    return tolerance
