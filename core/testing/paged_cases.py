"""Random paged KV caches with shuffled pages, and ForwardBatches over them, for backend tests
(the flashinfer and fa3 plugins test their metadata and kernels on these).

Every request's row maps position p to a slot on its own random page, at offset p % page
(the engine's allocator keeps rows page-consistent the same way). Unused row entries hold
real but wrong slots, so reading past a list changes the answer instead of going unnoticed.
A draft decode lays its branches out in the holey layout of DESIGN.md §5 and copies the
prefix's tail into every other branch's first page, as a spec plugin must.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from plugserve.attention.base import AttentionBackend, AttentionContext, AttentionLayer
from plugserve.attention.draft_kv import DraftKVLists, build_draft_kv_lists, indptr_from_lengths
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.pools.kv_pool import KVPool
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.structs.holey_layout import HoleyLayout
from plugserve.testing.conformance.paged import fp32_twin

LAYER_ID = 2


@dataclass
class Shape:
    page_size: int
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None

    def layer(self) -> AttentionLayer:
        return AttentionLayer(layer_id=LAYER_ID, num_heads=self.num_heads,
                              num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              scaling=self.head_dim**-0.5, sliding_window=self.sliding_window)

    def context(self, device: torch.device, *, max_batch_size: int = 8, spec_topk: int = 1,
                context_len: int = 256) -> AttentionContext:
        return AttentionContext(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim, page_size=self.page_size,
                                max_batch_size=max_batch_size, context_len=context_len,
                                dtype=self.dtype, device=device, spec_topk=spec_topk)


class Cases:
    """Builds paged caches and batches from one seeded generator."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(dtype=dtype, device=self.device)

    def _cache(self, shape: Shape, row_lens: list[int], row_width: int
               ) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
        page = shape.page_size
        num_pages = sum(-(-n // page) for n in row_lens) + 2
        pool = KVPool(num_pages=num_pages, page_size=page, layer_ids=[LAYER_ID],
                      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                      dtype=shape.dtype, device=self.device)
        buf = pool.k_buffer[LAYER_ID]
        pool.k_buffer[LAYER_ID].copy_(self.randn(*buf.shape, dtype=shape.dtype))
        pool.v_buffer[LAYER_ID].copy_(self.randn(*buf.shape, dtype=shape.dtype))
        num_rows = len(row_lens) + 3
        table = torch.randint(page, (num_pages + 1) * page, (num_rows, row_width),
                              generator=self.gen)
        rows = torch.randperm(num_rows, generator=self.gen)[: len(row_lens)]
        free = (torch.randperm(num_pages, generator=self.gen) + 1).tolist()
        for i, n in enumerate(row_lens):
            pos = torch.arange(n)
            pages = torch.tensor([free.pop() for _ in range(-(-n // page))])
            table[int(rows[i]), pos] = pages[pos // page] * page + pos % page
        return pool, table.to(self.device), rows.to(self.device)

    def _batch(self, mode: ForwardMode, pool: KVPool, table: torch.Tensor, rows: torch.Tensor,
               prefix: list[int], extend: list[int], positions: list[int],
               out_loc: torch.Tensor, **optional: object) -> ForwardBatch:
        return ForwardBatch.from_lengths(
            mode, input_ids=[0] * len(positions), positions=positions, out_cache_loc=out_loc,
            req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend, req_to_token=table,
            kv_pool=pool, device=self.device, **optional)

    def extend(self, shape: Shape, prefix_lens: list[int], extend_lens: list[int], *,
               tree_mask: bool = False, chain: bool = False) -> ForwardBatch:
        seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        pool, table, rows = self._cache(shape, seq, max(seq) + 2 * shape.page_size)
        out_loc = torch.cat([table[int(rows[i]), p:s] for i, (p, s) in
                             enumerate(zip(prefix_lens, seq, strict=True))])
        positions = [x for p, s in zip(prefix_lens, seq, strict=True) for x in range(p, s)]
        mode = ForwardMode.TARGET_VERIFY if tree_mask else ForwardMode.EXTEND
        mask = None
        if tree_mask:
            mask, positions = self.tree_masks(prefix_lens, extend_lens, chain=chain)
        return self._batch(mode, pool, table, rows, prefix_lens, extend_lens, positions,
                           out_loc, custom_mask=mask)

    def tree_masks(
        self, prefix_lens: list[int], extend_lens: list[int], *, chain: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """Random draft trees (`chain`: node j's parent is j - 1): node j sees the prefix,
        itself and its ancestors. Also the nodes' positions: `prefix + depth`, as a spec
        plugin gives them."""
        blocks, positions = [], []
        for prefix, count in zip(prefix_lens, extend_lens, strict=True):
            mask = torch.zeros(count, prefix + count, dtype=torch.bool)
            mask[:, :prefix] = True
            parent = [-1] + [j - 1 if chain else int(torch.randint(0, j, (1,), generator=self.gen))
                             for j in range(1, count)]
            for node in range(count):
                walk, depth = node, -1
                while walk >= 0:
                    mask[node, prefix + walk] = True
                    walk, depth = parent[walk], depth + 1
                positions.append(prefix + depth)
            blocks.append(mask.reshape(-1))
        return torch.cat(blocks).to(self.device), positions

    def decode(self, shape: Shape, seq_lens: list[int]) -> ForwardBatch:
        pool, table, rows = self._cache(shape, seq_lens, max(seq_lens) + 2 * shape.page_size)
        out_loc = torch.stack([table[int(rows[i]), n - 1] for i, n in enumerate(seq_lens)])
        return self._batch(ForwardMode.DECODE, pool, table, rows, [n - 1 for n in seq_lens],
                           [1] * len(seq_lens), [n - 1 for n in seq_lens], out_loc)

    def draft_decode(self, shape: Shape, prefix_lens: list[int], *, topk: int, step: int,
                     num_steps: int, lists: str = "core", row_slack: int = 0) -> ForwardBatch:
        """A topk>1 DRAFT_DECODE in the holey layout; `lists` picks how the spec side gives
        each branch its KV: "core" = `build_draft_kv_lists` (row[:prefix] + branch path),
        "lanes" = whole prefix pages + the branch's own first `last + step + 1` positions."""
        layout = HoleyLayout(shape.page_size, num_steps, topk)
        footprints = [layout.footprint(p) for p in prefix_lens]
        width = max(footprints) + shape.page_size + row_slack
        pool, table, rows = self._cache(shape, footprints, width)
        for i, prefix in enumerate(prefix_lens):  # tail copies into branches 1..topk-1
            base = layout.base(prefix)
            row = table[int(rows[i])]
            for start in layout.branch_starts(prefix)[1:]:
                pool.copy_slots(row[start : start + prefix - base], row[base:prefix])
        paths = layout.path_positions(prefix_lens, step)
        if lists == "core":
            kv = build_draft_kv_lists(table, rows, prefix_lens, paths)
        else:
            kv = _lane_lists(table, rows, prefix_lens, layout, step)
        out_loc = torch.cat([table[int(rows[i]), paths[i, :, -1].to(self.device)]
                             for i in range(len(prefix_lens))])
        positions = [p + step for p in prefix_lens for _ in range(topk)]
        fb = self._batch(ForwardMode.DRAFT_DECODE, pool, table, rows, prefix_lens,
                         [0] * len(prefix_lens), positions, out_loc)
        kv.store(fb)
        return fb


def _lane_lists(table: torch.Tensor, rows: torch.Tensor, prefix_lens: list[int],
                layout: HoleyLayout, step: int) -> DraftKVLists:
    parts, lens = [], []
    for i, prefix in enumerate(prefix_lens):
        row = table[int(rows[i])]
        for lane, start in enumerate(layout.branch_starts(prefix)):
            parts += [row[: layout.base(prefix)],
                      row[start : layout.draft_position(prefix, lane, step) + 1]]
            lens.append(prefix + step + 1)
    indptr = torch.tensor(indptr_from_lengths(lens), dtype=torch.int64, device=table.device)
    return DraftKVLists(indptr, torch.cat(parts), lens)


def native(fb: ForwardBatch, q: torch.Tensor, shape: Shape) -> torch.Tensor:
    """torch_native's answer, in fp32 over an fp32 copy of the cache."""
    twin = fp32_twin(fb)
    backend = TorchNativeBackend(shape.context(fb.req_to_token.device))
    backend.init_forward_metadata(twin)
    layer = shape.layer()
    if fb.mode.is_decode():
        return backend.forward_decode(q.float(), layer, twin)
    return backend.forward_extend(q.float(), layer, twin)


def native_tree_window(fb: ForwardBatch, q: torch.Tensor, shape: Shape) -> torch.Tensor:
    """torch_native's answer for a tree verify whose window counts token positions: the
    window folded into the mask (prefix keys at their index, tree keys at their positions)
    and the layer run without one. torch_native's own window counts rows, which agrees only
    for a chain."""
    assert fb.custom_mask is not None and shape.sliding_window is not None
    window = shape.sliding_window
    blocks, start, query = [], 0, 0
    for prefix, ext in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True):
        q_pos = fb.positions[query : query + ext].cpu()
        k_pos = torch.cat([torch.arange(prefix), q_pos])
        block = fb.custom_mask[start : start + ext * (prefix + ext)].cpu().view(ext, prefix + ext)
        blocks.append((block & (k_pos[None, :] > q_pos[:, None] - window)).reshape(-1))
        start += ext * (prefix + ext)
        query += ext
    folded = replace(fb, custom_mask=torch.cat(blocks).to(fb.custom_mask.device))
    return native(folded, q, replace(shape, sliding_window=None))


def run_backend(
    backend: AttentionBackend, fb: ForwardBatch, q: torch.Tensor, shape: Shape
) -> torch.Tensor:
    backend.init_forward_metadata(fb)
    layer = shape.layer()
    if fb.mode.is_decode():
        return backend.forward_decode(q, layer, fb)
    return backend.forward_extend(q, layer, fb)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error, relative where |want| > 1 (half types round relative to size)."""
    scale = want.float().abs().clamp(min=1.0)
    return ((got.float() - want.float()).abs() / scale).max().item()


TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
