"""A model's weights packed for the batch and prefill linears before the first request.

The linears that run a decode batch of more than a few rows on the CPU (the float32 panel
GEMM, `plugserve.kernels.panel_gemm`; the bf16 AMX linear, `plugserve.kernels.dense_amx`)
and the many-row linears of a prefill (oneDNN's packed matmul, `plugserve.kernels.
packed_linear`) read each weight in a layout of their own, made on first use: in float32 a
copy of every matrix each (about 0.3 s for the default model), paid by the first batch of 9
or more rows and by the first prefill. The server makes them at start instead (`plugserve
serve`, both engine modes), so no request waits on them, and reports their bytes
(`plugserve.model.weight_bytes.pack_bytes`); an offline `Engine` keeps making them on first
use, where a batch may never come (and the memory is then never spent). The LM head keeps
its many-row pack lazy: a prefill multiplies only its last row by it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from plugserve.kernels import dense_amx, packed_linear
from plugserve.kernels import panel_gemm as panel
from plugserve.model.layers import Linear
from plugserve.model.quant_weight import WeightHolder

log = logging.getLogger("plugserve.model")

# Rows of the probe each weight is asked about: a decode batch past the few-row kernels.
PROBE_ROWS = 16


def _holders(model: nn.Module) -> list[WeightHolder]:
    """Every linear layer of the model, and the LM head's holder (the embedding when tied)."""
    holders: list[WeightHolder] = [m for m in model.modules() if isinstance(m, Linear)]
    head = getattr(model, "lm_head_holder", None)
    if isinstance(head, WeightHolder) and all(head is not h for h in holders):
        holders.append(head)
    return holders


def make_batch_packs(model: nn.Module) -> int:
    """Pack every dense matrix of `model` that a PROBE_ROWS-row batch would run through a
    kernel with a pack of its own, and every linear layer's matrix for the GEMM library's
    many-row product; returns how many packs were made."""
    start, made = time.perf_counter(), 0
    head = getattr(model, "lm_head_holder", None)
    with torch.no_grad():
        for holder in _holders(model):
            weight = holder.weight
            if holder.quant is not None or weight.ndim != 2 or not weight.is_cpu:
                continue
            if holder is not head and packed_linear.packed(weight) is not None:
                made += 1
            probe = weight.new_empty((PROBE_ROWS, weight.shape[1]))
            if panel.applies(probe, weight):
                panel.pack(weight)
            elif dense_amx.applies(probe, weight):
                dense_amx.packed(weight)
            else:
                continue
            made += 1
    if made:
        log.info("packed %d weight matrices for batched decode and prefill in %.2f s", made,
                 time.perf_counter() - start)
    return made
