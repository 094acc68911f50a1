"""Sliding windows in a tree verify count token positions, not rows.

A draft tree's node at depth d sits at position `prefix + d` (its rope position), whatever
its row in the batch; a window of w tokens lets it see keys at positions `> prefix + d - w`:
prefix keys by their index, tree keys by their own positions. FlashInfer's `window_left`
counts rows (query r at `kv_len - qo_len + r`), which only agrees for a chain, so a verify on
a windowed layer folds the window into the custom mask instead and plans with
`window_left = -1`.
"""

from __future__ import annotations

import torch


def fold_window(
    custom_mask: torch.Tensor, positions: torch.Tensor, prefix_lens_cpu: list[int],
    extend_lens_cpu: list[int], window: int,
) -> torch.Tensor:
    """`custom_mask` (per request `[ext, prefix + ext]`, flattened) with the window applied."""
    blocks = []
    mask_start = query_start = 0
    for prefix, ext in zip(prefix_lens_cpu, extend_lens_cpu, strict=True):
        q_pos = positions[query_start : query_start + ext].to(torch.int64)
        k_pos = torch.cat([torch.arange(prefix, device=q_pos.device), q_pos])
        size = ext * (prefix + ext)
        block = custom_mask[mask_start : mask_start + size].view(ext, prefix + ext)
        blocks.append((block & (k_pos[None, :] > q_pos[:, None] - window)).reshape(-1))
        mask_start += size
        query_start += ext
    return torch.cat(blocks) if blocks else custom_mask
