"""Merge two partial attentions over disjoint key sets by their log-sum-exps.

With outputs o_a, o_b and natural-log LSEs l_a, l_b of the same queries, attention over the
union is `(o_a * e^(l_a - m) + o_b * e^(l_b - m)) / (e^(l_a - m) + e^(l_b - m))`, m = max.
A part that read no key contributes nothing whatever LSE the kernel reported for it (FA3 may
give +inf there), so callers say which rows had keys.
"""

from __future__ import annotations

import torch


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, has_keys_a: torch.Tensor,
    out_b: torch.Tensor, lse_b: torch.Tensor, has_keys_b: torch.Tensor,
) -> torch.Tensor:
    """outs `[tokens, heads, dim]`, LSEs `[heads, tokens]`, has_keys bool `[tokens]`."""
    neg_inf = torch.tensor(float("-inf"), device=out_a.device)
    la = torch.where(has_keys_a[:, None], lse_a.transpose(0, 1).float(), neg_inf)
    lb = torch.where(has_keys_b[:, None], lse_b.transpose(0, 1).float(), neg_inf)
    top = torch.maximum(la, lb)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa = torch.exp(la - top)[..., None]
    wb = torch.exp(lb - top)[..., None]
    merged = (out_a.float() * wa + out_b.float() * wb) / (wa + wb)
    return merged.to(out_a.dtype)
