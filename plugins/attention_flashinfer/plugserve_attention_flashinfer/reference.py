"""A CPU interpreter of FlashInfer's paged wrappers: the oracle the metadata is tested with.

`BatchPrefillWithPagedKVCacheWrapper` and `BatchDecodeWithPagedKVCacheWrapper` here take the
same `plan(...)` / `run(q, (k_cache, v_cache))` arguments the backend gives flashinfer's and
compute attention the way FlashInfer documents it, from those tensors alone:

- entry i's pages are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, each `[page_size, heads,
  head_dim]` of the NHD cache; its KV length is `(pages - 1) * page_size +
  kv_last_page_len[i]`, with `1 <= kv_last_page_len[i] <= page_size`;
- prefill: entry i's queries are `q[qo_indptr[i]:qo_indptr[i+1]]`; `custom_mask` is bool,
  per entry `[qo_len, kv_len]` row-major, concatenated; otherwise `causal` aligns query r to
  KV position `kv_len - qo_len + r` (keys at or before it);
- `window_left` w >= 0 keeps keys at positions >= the query's position - w (decode: the
  query sits at `kv_len - 1`); -1 keeps all;
- `sm_scale` defaults to `1/sqrt(head_dim)`; grouped-query heads share KV heads in order.

Arguments a real kernel would read out of bounds are refused with a ValueError. Math runs in
float32; the output has q's dtype. Slow (a loop over entries): for tests only.

The prefill wrapper also models how FlashInfer 0.7.2 picks its implementation (`backend`,
default "auto"): an `auto` wrapper resolves at its *first* `plan()` and keeps that choice
(`prefill.py`: `if self._backend == "auto": self._backend = determine_attention_backend(...)`);
`determine_attention_backend` (`utils.py`) picks "fa3" on an sm90 GPU when there is no custom
mask, the dtypes are not fp8/fp4 and the head dim is 64, 128 or 256, else "fa2"; the SM90
kernel refuses a custom mask at `run()` (`batch_prefill_sm90.cu`). `SIMULATED_SM90` says
whether the simulated GPU is an sm90 one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

WORKSPACE_BYTES = 16  # the interpreter needs no workspace; the backend asks how much to allocate

SIMULATED_SM90 = False  # tests set it to model an H100/H200
FA3_PREFILL_HEAD_DIMS = (64, 128, 256)  # utils.is_fa3_prefill_head_dim_supported (qk == vo)
_FA3_DTYPES = (torch.float16, torch.bfloat16)


def determine_attention_backend(
    sm90: bool, use_custom_mask: bool, dtype_q: torch.dtype, dtype_kv: torch.dtype,
    head_dim: int,
) -> str:
    """FlashInfer's `auto` choice for a prefill plan (see the module docstring)."""
    fa3_ok = (not use_custom_mask and dtype_q in _FA3_DTYPES and dtype_kv in _FA3_DTYPES
              and head_dim in FA3_PREFILL_HEAD_DIMS)
    return "fa3" if sm90 and fa3_ok else "fa2"


class MaskedFa3Error(RuntimeError):
    """The SM90 (fa3) prefill kernel was launched with a custom mask, which it refuses."""


def _host(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (FlashInfer's index type), got {t.dtype}")
    return [int(v) for v in t.cpu().tolist()]


class _PagedPlan:
    """What `plan` recorded, validated against itself."""

    def __init__(
        self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
        window_left: int, sm_scale: float | None,
    ) -> None:
        self.kv_indptr = _host(kv_indptr, "paged_kv_indptr")
        self.kv_indices = _host(kv_indices, "paged_kv_indices")
        self.last_page_len = _host(last_page_len, "paged_kv_last_page_len")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        n = len(self.last_page_len)
        if len(self.kv_indptr) != n + 1 or self.kv_indptr[0] != 0:
            raise ValueError(f"paged_kv_indptr must be [0, ...] of length {n + 1}, got "
                             f"{self.kv_indptr}")
        if any(b < a for a, b in zip(self.kv_indptr[:-1], self.kv_indptr[1:], strict=True)):
            raise ValueError(f"paged_kv_indptr must not decrease: {self.kv_indptr}")
        if self.kv_indptr[-1] > len(self.kv_indices):
            raise ValueError(f"paged_kv_indptr ends at {self.kv_indptr[-1]} but kv_indices has "
                             f"{len(self.kv_indices)} entries")
        self.kv_lens: list[int] = []
        for i, last in enumerate(self.last_page_len):
            pages = self.kv_indptr[i + 1] - self.kv_indptr[i]
            if pages == 0 or not 1 <= last <= page_size:
                raise ValueError(f"entry {i}: {pages} pages with last page length {last}; "
                                 f"needs >= 1 page and 1 <= last <= page_size ({page_size})")
            self.kv_lens.append((pages - 1) * page_size + last)
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.window_left = window_left
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def keys(
        self, entry: int, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry's K and V, `[kv_len, kv_heads, head_dim]`, read page by page."""
        if k_cache.dim() != 4 or k_cache.shape[1:] != (self.page_size, self.num_kv_heads,
                                                        self.head_dim):
            raise ValueError(f"k_cache must be NHD [pages, {self.page_size}, "
                             f"{self.num_kv_heads}, {self.head_dim}], got {tuple(k_cache.shape)}")
        pages = self.kv_indices[self.kv_indptr[entry] : self.kv_indptr[entry + 1]]
        if any(not 0 <= p < k_cache.shape[0] for p in pages):
            raise ValueError(f"entry {entry}: page ids {pages} outside the cache's "
                             f"{k_cache.shape[0]} pages")
        index = torch.tensor(pages, dtype=torch.int64, device=k_cache.device)
        n = self.kv_lens[entry]
        k = k_cache.index_select(0, index).flatten(0, 1)[:n]
        v = v_cache.index_select(0, index).flatten(0, 1)[:n]
        return k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """q `[qo, H, D]` over k/v `[kv, KVH, D]` with a bool `[qo, kv]` mask -> `[qo, H, D]`."""
        group = self.num_qo_heads // self.num_kv_heads
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv, D]
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        qf = q.float().transpose(0, 1)  # [H, qo, D]
        scores = torch.matmul(qf, kf.transpose(1, 2)) * self.sm_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key gives 0
        return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)

    def window(self, q_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        k_pos = torch.arange(kv_len, device=q_pos.device)
        if self.window_left < 0:
            return torch.ones(q_pos.numel(), kv_len, dtype=torch.bool, device=q_pos.device)
        return k_pos[None, :] >= q_pos[:, None] - self.window_left


def _split_cache(paged_kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, tuple | list):
        k_cache, v_cache = paged_kv_cache
        return k_cache, v_cache
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 backend: str = "auto", **_: Any) -> None:
        if kv_layout != "NHD":
            raise ValueError(f"the interpreter reads the NHD layout only, not {kv_layout!r}")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"the interpreter models backends auto, fa2 and fa3, not {backend!r}")
        self._plan: _PagedPlan | None = None
        self.backend = backend

    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, *,
        custom_mask: torch.Tensor | None = None, causal: bool = False, window_left: int = -1,
        sm_scale: float | None = None, q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None, **_: Any,
    ) -> None:
        plan = _PagedPlan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                          num_qo_heads, num_kv_heads, head_dim_qk, page_size, window_left,
                          sm_scale)
        if self.backend == "auto":  # resolved once, at the first plan, and kept
            self.backend = determine_attention_backend(
                SIMULATED_SM90, custom_mask is not None, q_data_type,
                kv_data_type or q_data_type, head_dim_qk)
        self.qo_indptr = _host(qo_indptr, "qo_indptr")
        if len(self.qo_indptr) != len(plan.kv_lens) + 1 or self.qo_indptr[0] != 0:
            raise ValueError(f"qo_indptr {self.qo_indptr} does not match "
                             f"{len(plan.kv_lens)} KV entries")
        self.masks: list[torch.Tensor] | None = None
        if custom_mask is not None:
            flat = custom_mask.reshape(-1).to(torch.bool)
            sizes = [(self.qo_indptr[i + 1] - self.qo_indptr[i]) * n
                     for i, n in enumerate(plan.kv_lens)]
            if flat.numel() != sum(sizes):
                raise ValueError(f"custom_mask has {flat.numel()} entries; the plan's "
                                 f"qo_len x kv_len blocks need {sum(sizes)}")
            self.masks = list(flat.split(sizes))
        self.causal = causal
        self._plan = plan

    def run(self, q: torch.Tensor, paged_kv_cache: Any, **_: Any) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan()")
        if self.backend == "fa3" and self.masks is not None:
            raise MaskedFa3Error("BatchPrefillWithPagedKVCacheWrapper planned a custom mask on "
                                 "its fa3 (SM90) backend, which FlashInfer refuses at run()")
        k_cache, v_cache = _split_cache(paged_kv_cache)
        if q.shape[0] != self.qo_indptr[-1]:
            raise ValueError(f"q has {q.shape[0]} rows but qo_indptr ends at "
                             f"{self.qo_indptr[-1]}")
        out = torch.zeros_like(q)
        for i, kv_len in enumerate(plan.kv_lens):
            lo, hi = self.qo_indptr[i], self.qo_indptr[i + 1]
            if hi == lo:
                continue
            k, v = plan.keys(i, k_cache, v_cache)
            q_pos = torch.arange(kv_len - (hi - lo), kv_len, device=q.device)
            allowed = plan.window(q_pos, kv_len)
            if self.masks is not None:
                allowed = allowed & self.masks[i].view(hi - lo, kv_len).to(q.device)
            elif self.causal:
                allowed = allowed & (torch.arange(kv_len, device=q.device)[None, :]
                                     <= q_pos[:, None])
            out[lo:hi] = plan.attend(q[lo:hi], k, v, allowed)
        return out


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 **_: Any) -> None:
        if kv_layout != "NHD":
            raise ValueError(f"the interpreter reads the NHD layout only, not {kv_layout!r}")
        self._plan: _PagedPlan | None = None

    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
        window_left: int = -1, sm_scale: float | None = None, **_: Any,
    ) -> None:
        self._plan = _PagedPlan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                                head_dim, page_size, window_left, sm_scale)

    def run(self, q: torch.Tensor, paged_kv_cache: Any, **_: Any) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan()")
        k_cache, v_cache = _split_cache(paged_kv_cache)
        if q.shape[0] != len(plan.kv_lens):
            raise ValueError(f"decode q has {q.shape[0]} rows for {len(plan.kv_lens)} entries")
        out = torch.zeros_like(q)
        for i, kv_len in enumerate(plan.kv_lens):
            k, v = plan.keys(i, k_cache, v_cache)
            q_pos = torch.tensor([kv_len - 1], device=q.device)
            out[i : i + 1] = plan.attend(q[i : i + 1], k, v, plan.window(q_pos, kv_len))
        return out


