"""ExampleBackend: a plugserve attention backend in plain PyTorch, written to be read.

`init_forward_metadata` turns the batch into groups of queries that read the same keys: one
group per request for extend modes (its new tokens), one per query for decode modes. Each
group knows its KV slots (gathered through `req_to_token`, never assumed contiguous), which
keys each query may attend to, and the positions the sliding window is measured in. Every
layer then gathers the group's K/V, masks and runs a float32 softmax.

It is slow (a Python loop per request and layer) and exact; a real backend would batch the
same index tables into one kernel launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.attention.base import AttentionBackend, AttentionLayer
from plugserve.attention.draft_kv import DraftKVLists
from plugserve.structs.forward_batch import ForwardBatch


@dataclass
class KeyGroup:
    """Queries `rows` of q read the KV at `slots`; `allowed[e, s]`: query e may attend key s
    (before any sliding window, which `query_pos` and `key_pos` measure)."""

    rows: slice
    slots: torch.Tensor  # [S] int64, in position order
    allowed: torch.Tensor  # [E, S] bool
    query_pos: torch.Tensor  # [E] int64
    key_pos: torch.Tensor  # [S] int64


class ExampleBackend(AttentionBackend):
    name = "example"

    # --- metadata: once per batch ------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        fb.attn_metadata = self.decode_groups(fb) if fb.mode.is_decode() else self.extend_groups(fb)

    def extend_groups(self, fb: ForwardBatch) -> list[KeyGroup]:
        """One group per request: its `extend_len` new tokens over its `seq_len` keys."""
        device = fb.positions.device
        groups = []
        query_start = mask_start = 0
        for i, (seq_len, prefix, ext) in enumerate(zip(
            fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True
        )):
            rows = slice(query_start, query_start + ext)
            if fb.custom_mask is not None:  # [ext, seq_len] per request, row-major, in order
                size = ext * seq_len
                allowed = fb.custom_mask[mask_start : mask_start + size].view(ext, seq_len)
                mask_start += size
            else:
                allowed = self.causal_mask(prefix, ext, seq_len, device)
            query_pos = fb.positions[rows]
            # Cached keys sit at their row positions; this batch's keys at their tokens'
            # positions (in tree verify: prefix + depth, not prefix + index).
            key_pos = torch.cat([torch.arange(prefix, device=device), query_pos])
            groups.append(KeyGroup(rows, self.row_slots(fb, i, seq_len), allowed.bool(),
                                   query_pos, key_pos))
            query_start += ext
        return groups

    def decode_groups(self, fb: ForwardBatch) -> list[KeyGroup]:
        """One group per query: its request's row, or its branch's draft KV list."""
        device = fb.positions.device
        lists = DraftKVLists.from_batch(fb)
        if lists is not None:  # topk>1 drafting: the lists win over seq_lens and the rows
            bounds = lists.kv_indptr_cpu()
            per_query = [lists.kv_indices[bounds[j] : bounds[j + 1]]
                         for j in range(lists.num_queries)]
        else:
            per_query = [self.row_slots(fb, i, n)
                         for i, n in enumerate(self.decode_kv_lens(fb))]
        return [
            KeyGroup(slice(j, j + 1), slots.long(),
                     torch.ones(1, slots.numel(), dtype=torch.bool, device=device),
                     fb.positions[j : j + 1], torch.arange(slots.numel(), device=device))
            for j, slots in enumerate(per_query)
        ]

    # The three facts the conformance suite's broken doubles get wrong, one method each.
    def row_slots(self, fb: ForwardBatch, request: int, length: int) -> torch.Tensor:
        """KV slots of the request's first `length` positions (pages may be anywhere)."""
        return fb.req_to_token[fb.req_pool_indices[request], :length].long()

    def causal_mask(self, prefix: int, ext: int, seq_len: int,
                    device: torch.device) -> torch.Tensor:
        """New token j sits at row position prefix + j and sees every position up to it."""
        query_row = prefix + torch.arange(ext, device=device)
        return torch.arange(seq_len, device=device)[None, :] <= query_row[:, None]

    def decode_kv_lens(self, fb: ForwardBatch) -> list[int]:
        """Keys each decode query reads: seq_len, which counts the token being decoded."""
        return list(fb.seq_lens_cpu)

    # --- attention: every layer ----------------------------------------------------------------
    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attend(q, layer, forward_batch)

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attend(q, layer, forward_batch)

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        """K/V of this batch are already in the pool (`forward` stored them first)."""
        k_buffer = fb.kv_pool.get_k(layer.layer_id)
        v_buffer = fb.kv_pool.get_v(layer.layer_id)
        group_size = layer.num_heads // layer.num_kv_heads  # query heads per KV head
        out = torch.empty_like(q)
        for group in fb.attn_metadata:
            allowed = group.allowed
            if layer.sliding_window is not None:
                first = group.query_pos[:, None] - layer.sliding_window
                allowed = allowed & (group.key_pos[None, :] > first)
            k = k_buffer[group.slots].float().repeat_interleave(group_size, dim=1)  # [S, H, D]
            v = v_buffer[group.slots].float().repeat_interleave(group_size, dim=1)
            scores = torch.einsum("ehd,shd->hes", q[group.rows].float(), k) * layer.scaling
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[group.rows] = torch.einsum("hes,shd->ehd", probs, v).to(q.dtype)
        return out
