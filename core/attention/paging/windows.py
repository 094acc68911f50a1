"""Sliding windows measured in token positions (the rule of a tree verify)."""

from __future__ import annotations

import torch


def window_mask_by_position(
    prefix_len: int, new_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Bool `[new, prefix + new]`: key inside the query's window of `window` tokens, by token
    *position*. Cached keys sit at their row positions; this batch's keys at their own
    `positions` (in a tree verify `prefix + depth`, not `prefix + index`: a node after the
    first branch would otherwise lose prefix keys its path still sees)."""
    q_pos = new_positions.to(torch.int64)
    k_pos = torch.cat([torch.arange(prefix_len, device=q_pos.device), q_pos])
    return k_pos[None, :] > q_pos[:, None] - window


def fold_window_into_mask(
    custom_mask: torch.Tensor, positions: torch.Tensor, prefix_lens_cpu: list[int],
    extend_lens_cpu: list[int], window: int,
) -> torch.Tensor:
    """A flat custom mask (per request `[ext, prefix + ext]`, row-major, concatenated) with
    the sliding window folded in by position; bool, same layout."""
    blocks = []
    mask_start = query_start = 0
    flat = custom_mask.reshape(-1) != 0
    for prefix, ext in zip(prefix_lens_cpu, extend_lens_cpu, strict=True):
        size = ext * (prefix + ext)
        block = flat[mask_start : mask_start + size].view(ext, prefix + ext)
        inside = window_mask_by_position(prefix, positions[query_start : query_start + ext],
                                         window)
        blocks.append((block & inside).reshape(-1))
        mask_start += size
        query_start += ext
    return torch.cat(blocks) if blocks else flat
