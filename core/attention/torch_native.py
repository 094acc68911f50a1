"""torch_native: the reference attention backend (any page size, CPU and CUDA).

It reads the paged cache exactly as every other backend must: request `i`'s KV lives at slots
`req_to_token[req_pool_indices[i], :seq_lens[i]]`. Extend runs request by request (causal with
the cached prefix as offset, or the custom tree mask); decode gathers a padded
[queries, max_len] slot table once per batch and runs one batched attention per layer. A topk>1
draft decode reads the per-branch KV lists of `plugserve.attention.draft_kv` instead.

On the CPU, decode runs the compiled kernel `plugserve.kernels.paged_decode` over that slot
table: it reads each key and value in place instead of gathering a padded copy per layer, and
computes in float32 whatever the cache's dtype (the model's, or a narrower `kv_cache_dtype`:
bf16 or fp8, widened as it is read). Causal extend (no tree mask; a cached prefix
and a sliding window are fine) runs `plugserve.kernels.prefill_attention`, a flash-attention
loop that skips the masked keys, 1.8x (fp32) to 3x (bf16) faster than SDPA's at 1,024
tokens on a Zen 4. In bf16 on a CPU with AMX it runs its AMX copy (head_dim a multiple of
32: 1.4-1.7x SDPA's flash attention at 512-1,024 tokens); for another head_dim there,
SDPA (which multiplies on the AMX tiles too) is the faster one and runs instead
(`prefill_attention.sdpa_is_faster`). Where the
kernels cannot be built (no compiler, no AVX-512 for the prefill one,
`PLUGSERVE_CPU_KERNELS=0`) both use `scaled_dot_product_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugserve.attention.base import AttentionBackend, AttentionContext, AttentionLayer
from plugserve.attention.paging import DraftKVLists, decode_draft_lists, window_mask_by_position
from plugserve.kernels import paged_decode as paged_decode_kernel
from plugserve.kernels import prefill_attention as prefill_kernel
from plugserve.kernels.packed_linear import upcasts_matmul
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.pools.slot_runs import read_rows, run_start
from plugserve.structs.forward_batch import ForwardBatch


@dataclass
class TorchNativeMetadata:
    # extend: per request, the KV slots it reads and its query/key boolean mask (True = attend);
    # None for a plain causal prompt without a cached prefix (SDPA's is_causal, which skips
    # the masked half instead of computing and discarding it), and for every causal request
    # where the prefill kernel runs (it takes the prefix length instead)
    kv_slots: list[torch.Tensor]
    masks: list[torch.Tensor | None]
    query_starts: list[int]
    # decode: padded slot table and validity, [batch, max_len] (key positions and validity
    # None where the decode kernel reads rows of equal length: it needs no mask)
    padded_slots: torch.Tensor | None = None
    padded_key_pos: torch.Tensor | None = None
    padded_valid: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None  # [queries] keys each decode query reads
    # the decode kernel's int64 operands, made once per batch rather than once per layer:
    # the slot table, the lengths and the first key of a full (not windowed) layer (zeros)
    kernel_slots: torch.Tensor | None = None
    kernel_lens: torch.Tensor | None = None
    kernel_first_key: torch.Tensor | None = None
    # the new tokens' slots as int64, where a full layer stores its k and v (made by the
    # first layer's plan, read by the others)
    kernel_store_slots: torch.Tensor | None = None
    # a full layer's plan operands (store slots, slot table, first keys, lengths): the same
    # objects for every such layer, so the decode stack passes them once
    kernel_full_layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        # Decided once: the compiled decode kernel on a CPU that can build it.
        self.decode_kernel = ctx.device.type == "cpu" and paged_decode_kernel.available()
        # Its plain loops (no AVX-512, or a head_dim its vector code does not take) are
        # correct but slower than SDPA: vector builds and head_dims only; and not in bf16 on
        # a CPU where SDPA multiplies on AMX tiles, unless the kernel's AMX copy applies.
        self.prefill_kernel = (
            ctx.device.type == "cpu" and ctx.head_dim % 16 == 0 and prefill_kernel.available()
            and prefill_kernel.isa() != "none" and not prefill_kernel.sdpa_is_faster(ctx.dtype, ctx.head_dim)
        )

    def _extend_by_kernel(self, fb: ForwardBatch) -> bool:
        """True when this extend batch runs the prefill kernel: causal (no tree mask), query j
        of a request at its prefix length + j. It then needs no mask from the metadata."""
        return self.prefill_kernel and fb.custom_mask is None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        rows = fb.req_pool_indices
        if fb.mode.is_decode():
            lists = decode_draft_lists(fb)
            if lists is not None:
                fb.attn_metadata = self._list_metadata(lists, rows.device)
                return
            max_len = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 1
            slots = fb.req_to_token[rows, :max_len]
            if self.decode_kernel and min(fb.seq_lens_cpu, default=max_len) == max_len:
                # No padding (batch 1 among others), and the kernel reads [first key, length)
                # of each row: no mask to build.
                meta = TorchNativeMetadata([], [], [], slots, kv_lens=fb.seq_lens)
            else:
                key_pos = torch.arange(max_len, device=rows.device)
                valid = key_pos[None, :] < fb.seq_lens[:, None]
                slots = torch.where(valid, slots, torch.zeros_like(slots))
                meta = TorchNativeMetadata([], [], [], slots, key_pos, valid, fb.seq_lens)
            if self.decode_kernel:
                meta.kernel_slots = slots.to(torch.int64).contiguous()
                meta.kernel_lens = fb.seq_lens.to(torch.int64)
                meta.kernel_first_key = torch.zeros_like(meta.kernel_lens)
            fb.attn_metadata = meta
            return
        by_kernel = self._extend_by_kernel(fb)
        kv_slots: list[torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        starts: list[int] = []
        query_start = 0
        mask_start = 0
        for i, (seq_len, prefix_len, ext_len) in enumerate(
            zip(fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True)
        ):
            kv_slots.append(fb.req_to_token[rows[i], :seq_len])
            mask: torch.Tensor | None = None
            if fb.custom_mask is not None:
                size = ext_len * seq_len
                mask = fb.custom_mask[mask_start : mask_start + size].view(ext_len, seq_len)
                mask_start += size
            elif prefix_len > 0 and not by_kernel:
                q_pos = torch.arange(prefix_len, prefix_len + ext_len, device=rows.device)
                k_pos = torch.arange(seq_len, device=rows.device)
                mask = k_pos[None, :] <= q_pos[:, None]
            masks.append(mask)
            starts.append(query_start)
            query_start += ext_len
        fb.attn_metadata = TorchNativeMetadata(kv_slots, masks, starts)

    @staticmethod
    def _list_metadata(lists: DraftKVLists, device: torch.device) -> TorchNativeMetadata:
        """Per-query KV lists (topk>1 drafting): a padded [queries, longest] slot table."""
        max_len = max(lists.kv_lens_cpu) if lists.kv_lens_cpu else 1
        key_pos = torch.arange(max_len, device=device)
        lens = torch.tensor(lists.kv_lens_cpu, dtype=torch.int64, device=device)
        starts = torch.tensor(lists.kv_indptr_cpu()[:-1], dtype=torch.int64, device=device)
        valid = key_pos[None, :] < lens[:, None]
        flat = (starts[:, None] + key_pos[None, :]).clamp(max=max(lists.kv_indices.numel() - 1, 0))
        indices = lists.kv_indices.to(device)
        slots = indices[flat] if indices.numel() else torch.zeros_like(flat)
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        return TorchNativeMetadata([], [], [], slots, key_pos, valid, lens)

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        fb = forward_batch
        meta: TorchNativeMetadata = fb.attn_metadata
        k_buf = fb.kv_pool.get_k(layer.layer_id)
        v_buf = fb.kv_pool.get_v(layer.layer_id)
        out = torch.empty_like(q)
        dtype = _attention_dtype(q)
        use_kernel = self._extend_by_kernel(fb)
        for i, ext_len in enumerate(fb.extend_seq_lens_cpu):
            start = meta.query_starts[i]
            slots = fb.kv_pool.slots_for_layer(layer.layer_id, meta.kv_slots[i])
            run = run_start(slots)  # K and V are read at the same slots
            if use_kernel:
                # The kernel takes K/V of q's dtype: a narrower cache is widened here.
                seq_out = prefill_kernel.prefill_attention(
                    q[start : start + ext_len], read_rows(k_buf, slots, run).to(q.dtype),
                    read_rows(v_buf, slots, run).to(q.dtype), layer.scaling,
                    fb.extend_prefix_lens_cpu[i], layer.sliding_window,
                )
                if ext_len == q.shape[0]:  # the batch's only sequence: no copy into `out`
                    return seq_out
                out[start : start + ext_len] = seq_out
                continue
            mask = meta.masks[i]
            if layer.sliding_window is not None:
                if mask is None:
                    mask = torch.ones(ext_len, ext_len, dtype=torch.bool, device=q.device).tril()
                mask = mask & window_mask_by_position(
                    fb.extend_prefix_lens_cpu[i], fb.positions[start : start + ext_len],
                    layer.sliding_window,
                )
            qi = q[start : start + ext_len].to(dtype).transpose(0, 1)  # [H, E, D]
            ki = read_rows(k_buf, slots, run).to(dtype).transpose(0, 1)  # [KVH, S, D]
            vi = read_rows(v_buf, slots, run).to(dtype).transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[start : start + ext_len] = oi[0].transpose(0, 1).to(q.dtype)
        return out

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        fb = forward_batch
        meta: TorchNativeMetadata = fb.attn_metadata
        if self.decode_kernel:
            return self._decode_in_place(q, layer, fb, meta)
        assert meta.padded_slots is not None and meta.padded_valid is not None
        assert meta.padded_key_pos is not None and meta.kv_lens is not None
        # index_select on the flattened table is many times faster than fancy indexing.
        flat = fb.kv_pool.slots_for_layer(layer.layer_id, meta.padded_slots.reshape(-1))
        shape = (*meta.padded_slots.shape, layer.num_kv_heads, layer.head_dim)
        dtype = _attention_dtype(q)
        k = fb.kv_pool.get_k(layer.layer_id).index_select(0, flat).view(shape).to(dtype)
        v = fb.kv_pool.get_v(layer.layer_id).index_select(0, flat).view(shape).to(dtype)
        valid = meta.padded_valid
        if layer.sliding_window is not None:
            first_key = meta.kv_lens[:, None] - layer.sliding_window
            valid = valid & (meta.padded_key_pos[None, :] >= first_key)
        out = F.scaled_dot_product_attention(
            q.to(dtype).unsqueeze(2),  # [B, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.squeeze(2).to(q.dtype)

    def paged_decode_plan(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> PagedDecodePlan | None:
        fb = forward_batch
        if not self.decode_kernel or not fb.mode.is_decode():
            return None
        meta: TorchNativeMetadata = fb.attn_metadata
        if meta.kernel_slots is None:  # a draft's per-branch lists: `forward` builds them
            return None
        pool = fb.kv_pool
        if layer.sliding_window is None and not pool.is_windowed(layer.layer_id):
            # A full layer: the operands every such layer shares, made once per batch.
            if meta.kernel_full_layer is None:
                assert meta.kernel_lens is not None and meta.kernel_first_key is not None
                if meta.kernel_store_slots is None:
                    meta.kernel_store_slots = fb.out_cache_loc.to(torch.int64)
                meta.kernel_full_layer = (meta.kernel_store_slots, meta.kernel_slots,
                                          meta.kernel_first_key, meta.kernel_lens)
            return PagedDecodePlan(pool.get_k(layer.layer_id), pool.get_v(layer.layer_id),
                                   *meta.kernel_full_layer, layer.scaling)
        # `set_kv` writes where `slots_for_layer` maps the new tokens' slots (its contract:
        # the same slots for a layer that is not windowed).
        if fb.kv_pool.is_windowed(layer.layer_id):
            store_slots = fb.kv_pool.slots_for_layer(layer.layer_id, fb.out_cache_loc)
            store_slots = store_slots.to(torch.int64)
        else:
            if meta.kernel_store_slots is None:
                meta.kernel_store_slots = fb.out_cache_loc.to(torch.int64)
            store_slots = meta.kernel_store_slots
        slots, first_key, kv_lens = self._kernel_operands(layer, fb, meta)
        return PagedDecodePlan(
            fb.kv_pool.get_k(layer.layer_id), fb.kv_pool.get_v(layer.layer_id),
            store_slots, slots, first_key, kv_lens, layer.scaling,
        )

    @staticmethod
    def _kernel_operands(
        layer: AttentionLayer, fb: ForwardBatch, meta: TorchNativeMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode kernel's int64 (slot table, first keys, lengths) for `layer`."""
        assert meta.padded_slots is not None and meta.kv_lens is not None
        slots, kv_lens, first_key = meta.kernel_slots, meta.kernel_lens, meta.kernel_first_key
        if slots is None or kv_lens is None or first_key is None:  # a draft's per-branch lists
            slots = meta.padded_slots.to(torch.int64).contiguous()
            kv_lens = meta.kv_lens.to(torch.int64)
            first_key = torch.zeros_like(kv_lens)
        if fb.kv_pool.is_windowed(layer.layer_id):
            slots = fb.kv_pool.slots_for_layer(layer.layer_id, slots).to(torch.int64).contiguous()
        if layer.sliding_window is not None:
            first_key = (kv_lens - layer.sliding_window).clamp(min=0)
        return slots, first_key, kv_lens

    def _decode_in_place(
        self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, meta: TorchNativeMetadata
    ) -> torch.Tensor:
        slots, first_key, kv_lens = self._kernel_operands(layer, fb, meta)
        return paged_decode_kernel.paged_decode(
            q, fb.kv_pool.get_k(layer.layer_id), fb.kv_pool.get_v(layer.layer_id),
            slots, first_key, kv_lens, layer.scaling,
        )


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """Half-precision attention on a CPU without native half kernels runs in float32 (the
    same reason, and the same test, as the model's matmuls)."""
    return torch.float32 if upcasts_matmul(q) else q.dtype
