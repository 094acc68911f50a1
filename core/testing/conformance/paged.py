"""Hand-built paged KV caches with SHUFFLED page tables, and the ForwardBatches that read them.

This is the one copy of the harness (the Triton plugin's tests import it from here). Every
cache is filled with random K/V; each request gets a random row of `req_to_token`, and each
page of that row a random physical page, so a request's slots are contiguous only inside one
page. Row entries past a request's length hold real but wrong slots: a backend that reads past
its lengths gets wrong numbers, not an index error.

Batches follow what the engine sends (`plugserve.structs.forward_batch`): extend (prefill,
chunked prefill, mixed), decode, tree verify with a custom mask (positions are the nodes'
depths past the prefix, as in speculative verify) and topk>1 draft decode in the holey layout
with per-branch KV lists (`plugserve.attention.draft_kv`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from plugserve.attention.base import AttentionContext, AttentionLayer
from plugserve.attention.draft_kv import build_draft_kv_lists, holey_branch_positions
from plugserve.pools.kv_pool import KVPool, to_cache_dtype
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.holey_layout import HoleyLayout

LAYER_ID = 3


def pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


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
    """Builds paged caches, ForwardBatches, layers and contexts for one test."""

    def __init__(self, *, device: torch.device | str, seed: int) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(dtype=dtype, device=self.device)

    def cache(
        self, *, batch: int, row_width: int, num_pages: int, page_size: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype, layer_ids: Sequence[int] = (LAYER_ID,),
    ) -> PagedCache:
        pool = KVPool(num_pages=num_pages, page_size=page_size, layer_ids=list(layer_ids),
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                      device=self.device)
        for layer_id in pool.layer_ids:
            shape = pool.k_buffer[layer_id].shape
            pool.k_buffer[layer_id].copy_(self.randn(*shape, dtype=dtype))
            pool.v_buffer[layer_id].copy_(self.randn(*shape, dtype=dtype))
        num_rows = batch + 3
        # Unused entries hold real but wrong slots: reading past a list shows up as an error.
        req_to_token = torch.randint(page_size, (num_pages + 1) * page_size,
                                     (num_rows, row_width), generator=self.generator)
        rows = torch.randperm(num_rows, generator=self.generator)[:batch]
        pages = (torch.randperm(num_pages, generator=self.generator) + 1).tolist()
        return PagedCache(pool, req_to_token.to(self.device), rows.to(self.device), page_size,
                          self.generator, pages)

    def _mapped_cache(
        self, lengths: list[int], *, page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, layer_ids: Sequence[int],
    ) -> PagedCache:
        """A cache whose request `i` has row positions `[0, lengths[i])` mapped to slots."""
        cache = self.cache(batch=len(lengths), row_width=max(lengths) + page_size,
                           num_pages=sum(pages_for(n, page_size) for n in lengths) + 2,
                           page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           dtype=dtype, layer_ids=layer_ids)
        for i, n in enumerate(lengths):
            cache.map_positions(i, range(n))
        return cache

    def extend_batch(
        self, *, prefix_lens: list[int], extend_lens: list[int], page_size: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype, tree_mask: bool = False,
        mode: ForwardMode = ForwardMode.EXTEND, layer_ids: Sequence[int] = (LAYER_ID,),
    ) -> ForwardBatch:
        """Request i has `prefix_lens[i]` cached tokens and `extend_lens[i]` new ones. With
        `tree_mask` the new tokens are random draft trees (positions = prefix + depth)."""
        pairs = list(zip(prefix_lens, extend_lens, strict=True))
        seq_lens = [p + e for p, e in pairs]
        cache = self._mapped_cache(seq_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, dtype=dtype, layer_ids=layer_ids)
        out_loc = torch.cat([cache.slots(i, torch.arange(p, p + e)) for i, (p, e) in
                             enumerate(pairs)])
        mask = None
        offsets = [list(range(e)) for e in extend_lens]
        if tree_mask:
            mask, offsets = self.random_trees(prefix_lens, extend_lens)
        positions = torch.tensor([p + d for (p, _), depths in zip(pairs, offsets, strict=True)
                                  for d in depths], dtype=torch.int64)
        return self._batch(mode, cache, positions, out_loc, seq_lens, prefix_lens, extend_lens,
                           mask)

    def tree_masks(self, prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """Flattened masks of random draft trees: node j sees the prefix and its ancestors."""
        return self.random_trees(prefix_lens, extend_lens)[0]

    def random_trees(
        self, prefix_lens: list[int], extend_lens: list[int]
    ) -> tuple[torch.Tensor, list[list[int]]]:
        """(flattened custom mask, each request's node depths): node j's parent is a random
        earlier node, node 0 is the root (depth 0)."""
        blocks = []
        all_depths = []
        for prefix, count in zip(prefix_lens, extend_lens, strict=True):
            mask = torch.zeros(count, prefix + count, dtype=torch.bool)
            mask[:, :prefix] = True
            parents = [-1] + [int(torch.randint(0, j, (1,), generator=self.generator))
                              for j in range(1, count)]
            depths = []
            for node in range(count):
                walk = node
                depth = -1
                while walk >= 0:
                    mask[node, prefix + walk] = True
                    walk = parents[walk]
                    depth += 1
                depths.append(depth)
            blocks.append(mask.reshape(-1))
            all_depths.append(depths)
        return torch.cat(blocks).to(self.device), all_depths

    def decode_batch(
        self, *, seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, layer_ids: Sequence[int] = (LAYER_ID,),
        mode: ForwardMode = ForwardMode.DECODE,
    ) -> ForwardBatch:
        cache = self._mapped_cache(seq_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, dtype=dtype, layer_ids=layer_ids)
        out_loc = torch.cat([cache.slots(i, torch.tensor([n - 1])) for i, n in enumerate(seq_lens)])
        positions = torch.tensor([n - 1 for n in seq_lens])
        return self._batch(mode, cache, positions, out_loc, seq_lens,
                           [n - 1 for n in seq_lens], [1] * len(seq_lens), None)

    def draft_decode_batch(
        self, *, prefix_lens: list[int], topk: int, step: int, num_steps: int, page_size: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        layer_ids: Sequence[int] = (LAYER_ID,), lane_entries: bool = False,
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """A DRAFT_DECODE batch in the holey layout of DESIGN.md §5, with per-branch lists.

        Returns the batch and the `[batch, topk, step + 1]` row positions of the branch paths.
        Every branch's first page gets a copy of the prefix's tail KV, as the spec plugin does.
        `lane_entries=False`: one batch entry per request (seq_len = its prefix, no new
        tokens). `lane_entries=True`: what the EAGLE plugin sends, one entry per branch (the
        request's row repeated, prefix `L + step`, one new token); the lists win either way.
        """
        layout = HoleyLayout(page_size, num_steps, topk)
        footprints = [layout.footprint(p) for p in prefix_lens]
        cache = self._mapped_cache(footprints, page_size=page_size, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, dtype=dtype, layer_ids=layer_ids)
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
        if lane_entries:
            lanes = [p + step for p in prefix_lens for _ in range(topk)]
            lane_cache = replace(cache, rows=cache.rows.repeat_interleave(topk))
            fb = self._batch(ForwardMode.DRAFT_DECODE, lane_cache, positions, out_loc,
                             [n + 1 for n in lanes], lanes, [1] * len(lanes), None)
        else:
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
              sliding_window: int | None = None, layer_id: int = LAYER_ID) -> AttentionLayer:
        return AttentionLayer(layer_id=layer_id, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, scaling=head_dim**-0.5,
                              sliding_window=sliding_window)

    def context(self, layer: AttentionLayer, page_size: int, dtype: torch.dtype,
                spec_topk: int = 1, max_batch_size: int = 8,
                context_len: int = 256) -> AttentionContext:
        return AttentionContext(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                                head_dim=layer.head_dim, page_size=page_size,
                                max_batch_size=max_batch_size, context_len=context_len,
                                dtype=dtype, device=self.device, spec_topk=spec_topk)


def fp32_twin(fb: ForwardBatch) -> ForwardBatch:
    """The same batch over an fp32 copy of its KV pool (an exact oracle for half dtypes); a
    new batch even in fp32, so the reference's metadata never replaces the original's."""
    pool = fb.kv_pool
    if pool.dtype == torch.float32:
        return replace(fb, attn_metadata=None, extra=dict(fb.extra))
    twin = KVPool(num_pages=pool.num_pages, page_size=pool.page_size, layer_ids=pool.layer_ids,
                  num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=torch.float32,
                  device=pool.device)
    for layer_id in pool.layer_ids:
        twin.k_buffer[layer_id].copy_(pool.k_buffer[layer_id])
        twin.v_buffer[layer_id].copy_(pool.v_buffer[layer_id])
    return replace(fb, kv_pool=twin, attn_metadata=None, extra=dict(fb.extra))


def narrow_kv_pool(pool: KVPool, dtype: torch.dtype) -> None:
    """Make `pool` store `dtype` (a narrower KV cache dtype), its current values converted as
    the pool stores them (`to_cache_dtype`)."""
    for buffers in (pool.k_buffer, pool.v_buffer):
        for layer_id, buffer in buffers.items():
            buffers[layer_id] = to_cache_dtype(buffer, dtype)
    pool.dtype = dtype
