"""The kernel oracle: attention in float64, from first principles, and the tolerances.

It shares no code with any backend. For every query it gathers the keys the contract says
it reads, through `req_to_token` (or the per-branch draft KV lists), decides which of them it
may attend to, and runs a float64 softmax:

- extend modes: request i reads row `req_to_token[req_pool_indices[i], :seq_lens[i]]`; new
  token j (row position `prefix_i + j`) attends to row positions `<= prefix_i + j` (causal,
  offset by the cached prefix), or, with `custom_mask`, to the True entries of its row of the
  request's `[extend_len, seq_len]` block;
- decode modes: one query per request reading `row[:seq_len]`, or, when the draft KV lists
  are in `forward_batch.extra`, one query per list reading that list;
- sliding window W: a query at position p also needs the key's position > p - W. Positions
  are `forward_batch.positions` for the queries; a key's position is its row position, except
  for the tokens of this batch, whose positions are their queries' (in tree verify a node's
  position is prefix + depth, not prefix + index). In a draft KV list, index = position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugserve.attention.base import AttentionLayer
from plugserve.attention.draft_kv import DRAFT_KV_INDICES, DRAFT_KV_LENS_CPU
from plugserve.structs.forward_batch import ForwardBatch


@dataclass(frozen=True)
class Tolerance:
    """`|got - want| <= atol + rtol * |want|`, element-wise, against the float64 oracle."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g}"


# Inputs are the same rounded values for both sides, so the error is the kernel's own
# arithmetic: fp32 near exact; fp16/bf16 about one or two ulps of the output (|out| < ~4).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=4e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}


@dataclass
class QueryGroup:
    """Queries `rows` of q reading KV `slots`; `allowed[e, s]`: query e may attend key s."""

    request: int
    rows: slice
    slots: torch.Tensor  # [S] int64
    allowed: torch.Tensor  # [E, S] bool


def _extend_groups(fb: ForwardBatch, window: int | None) -> list[QueryGroup]:
    groups = []
    positions = fb.positions.cpu()
    table = fb.req_to_token.cpu()
    rows = fb.req_pool_indices.cpu().tolist()
    start = 0
    mask_start = 0
    for i, (seq_len, prefix, ext) in enumerate(zip(
        fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True
    )):
        slots = table[rows[i], :seq_len].to(torch.int64)
        key_row = torch.arange(seq_len)
        if fb.custom_mask is not None:
            size = ext * seq_len
            allowed = fb.custom_mask.cpu()[mask_start : mask_start + size].view(ext, seq_len)
            allowed = allowed.to(torch.bool)
            mask_start += size
        else:
            allowed = key_row[None, :] <= (prefix + torch.arange(ext))[:, None]
        if window is not None:
            q_pos = positions[start : start + ext]
            key_pos = torch.cat([key_row[:prefix], q_pos])
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - window)
        groups.append(QueryGroup(i, slice(start, start + ext), slots, allowed))
        start += ext
    return groups


def _decode_groups(fb: ForwardBatch, window: int | None) -> list[QueryGroup]:
    positions = fb.positions.cpu()
    if DRAFT_KV_INDICES in fb.extra:
        indices = fb.extra[DRAFT_KV_INDICES].cpu().to(torch.int64)
        lens = list(fb.extra[DRAFT_KV_LENS_CPU])
        offsets = [sum(lens[:q]) for q in range(len(lens))]
        lists = [indices[o : o + n] for o, n in zip(offsets, lens, strict=True)]
    else:
        table = fb.req_to_token.cpu()
        rows = fb.req_pool_indices.cpu().tolist()
        lists = [table[row, :n].to(torch.int64) for row, n in zip(rows, fb.seq_lens_cpu,
                                                                  strict=True)]
    groups = []
    for q, slots in enumerate(lists):
        key_pos = torch.arange(slots.numel())
        allowed = torch.ones(1, slots.numel(), dtype=torch.bool)
        if window is not None:
            allowed &= key_pos[None, :] > int(positions[q]) - window
        groups.append(QueryGroup(q, slice(q, q + 1), slots, allowed))
    return groups


def query_groups(fb: ForwardBatch, layer: AttentionLayer) -> list[QueryGroup]:
    """Every query of the batch with the keys it reads and may attend to."""
    if fb.mode.is_decode():
        return _decode_groups(fb, layer.sliding_window)
    return _extend_groups(fb, layer.sliding_window)


def reference_attention(
    fb: ForwardBatch, q: torch.Tensor, layer: AttentionLayer, k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
) -> torch.Tensor:
    """float64 `[num_tokens, num_heads, head_dim]` on the CPU. `k_buffer`/`v_buffer`: the
    layer's whole KV buffers `[slots, num_kv_heads, head_dim]` with this batch's K/V stored."""
    group_size = layer.num_heads // layer.num_kv_heads
    k_all = k_buffer.detach().cpu().double()
    v_all = v_buffer.detach().cpu().double()
    q64 = q.detach().cpu().double()
    out = torch.zeros(q64.shape, dtype=torch.float64)
    for group in query_groups(fb, layer):
        # Query head h reads KV head h // group_size (as HF's repeat_kv).
        k = k_all[group.slots].repeat_interleave(group_size, dim=1)  # [S, H, D]
        v = v_all[group.slots].repeat_interleave(group_size, dim=1)
        scores = torch.einsum("ehd,shd->hes", q64[group.rows], k) * layer.scaling
        scores = scores.masked_fill(~group.allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[group.rows] = torch.einsum("hes,shd->ehd", probs, v)
    return out


def request_of_token(fb: ForwardBatch, token: int) -> int:
    """Which batch entry query row `token` belongs to (for error messages)."""
    if fb.mode.is_decode():
        return token
    end = 0
    for i, ext in enumerate(fb.extend_seq_lens_cpu):
        end += ext
        if token < end:
            return i
    return -1
