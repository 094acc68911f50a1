"""Which decode batches a `DecodeStack` runs past the few-row kernel, and the packs it needs.

Past the few-row kernel (9 .. ~96 rows) the op-by-op path multiplies each dense projection
with the kernel `plugserve.model.layers._dense_linear` picks for those rows: the bf16 AMX
linear (`plugserve.kernels.dense_amx`) where AMX runs, the panel GEMM
(`plugserve.kernels.panel_gemm`: float32, and bf16 / fp16 where the CPU has no native half
dot products), each against a pack of the weight it caches per weight
(and, for the panel GEMM, per ISA copy). `BatchPacks` asks the same `applies` and takes the
packs from the same caches, so the compiled step runs the same kernels on the same packs,
with the same results. It asks the caches again whenever a weight's version counter or the
ISA copy in use moves (a weight written in place, a switch of copy): exactly when they make
a new pack. A stack whose projections are all quantized (a GGUF file's) takes every batch
past the few-row kernel: the op-by-op path multiplies those rows with the many-row quantized
path (`plugserve.kernels.quant_linear`), which reads the blocks as stored (no pack), and the
compiled step calls the same. Rows no batch kernel of the stack's dtype takes (oneDNN's, the
widening GEMM's, a mix of dense and quantized projections) stay on the op-by-op path, as does
every batch with `PLUGSERVE_BATCH_STACK=0`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from plugserve.kernels import build, dense_amx, quant_linear
from plugserve.kernels import panel_gemm as panel
from plugserve.kernels.packed_linear import HALF, half_is_native, weight_version

ENV_SWITCH = "PLUGSERVE_BATCH_STACK"


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


_ENABLED = enabled_by_environment()

# A layer's projections in the order the compiled stack takes their packs.
PROJECTIONS = ("qkv", "o", "gate_up", "down")

LayerMatrices = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _kind(weights: Sequence[torch.Tensor]) -> str | None:
    """'panel' (float32, or bf16 / fp16 where the CPU has no native half dot products),
    'amx' (bf16, every matrix's inputs a multiple of the AMX tile) or None: the batch linear
    every one of `weights` takes, if they all take the same."""
    if not weights or any(w.ndim != 2 or not w.is_cpu for w in weights):
        return None
    dtypes = {w.dtype for w in weights}
    if dtypes == {torch.float32}:
        return "panel"
    if len(dtypes) == 1 and weights[0].dtype in HALF and not half_is_native(weights[0].dtype):
        return "panel"
    tiled = all(w.shape[1] > 0 and w.shape[1] % dense_amx.TILE_K == 0 for w in weights)
    return "amx" if dtypes == {torch.bfloat16} and tiled else None


class BatchPacks:
    """The batch kernel and packs of a stack's dense projections (`layers`: per layer its
    qkv, o, gate_up and down matrices, or None where any of them is quantized; with
    `all_quantized` every projection of every layer is, and batches need no pack)."""

    def __init__(self, layers: Sequence[LayerMatrices | None], all_quantized: bool = False,
                 ) -> None:
        dense = [m for m in layers if m is not None]
        self.weights = [w for m in dense for w in m]
        self.kind = _kind(self.weights) if dense and len(dense) == len(layers) else None
        if all_quantized and layers:
            self.kind = "quantized"
        self._key: tuple[object, ...] | None = None

    def takes(self, hidden: torch.Tensor) -> bool:
        """True when the op-by-op path multiplies every projection of a step of `hidden`
        [rows, hidden_size] with this stack's batch kernel (`_dense_linear`'s choice: past
        the few-row kernel, where the kernel `applies`), no gradient being wanted."""
        if self.kind is None or not _ENABLED:
            return False
        if self.kind == "quantized":
            return (
                not (torch.is_grad_enabled() and hidden.requires_grad) and hidden.ndim == 2
                and hidden.shape[0] > quant_linear.MAX_FEW_ROWS and hidden.is_cpu
                and hidden.dtype in (torch.float32, torch.bfloat16)
            )
        first = self.weights[0]
        if torch.is_grad_enabled() and (hidden.requires_grad or first.requires_grad):
            return False
        if self.kind == "panel":
            return panel.applies(hidden, first)
        return dense_amx.applies(hidden, first)

    def packs_if_changed(self) -> list[list[torch.Tensor]] | None:
        """Per projection (`PROJECTIONS`), every layer's pack from the kernel's cache, where a
        weight or the ISA copy changed since the last call (the first call too); else None."""
        if self.kind == "quantized":
            return None  # the blocks are multiplied as stored
        library = build.library()
        assert library is not None, "a DecodeStack needs the CPU kernels"
        key = (library.isa(), *(weight_version(w) for w in self.weights))
        if key == self._key:
            return None
        make = panel.pack if self.kind == "panel" else dense_amx.packed
        packs = [make(w) for w in self.weights]
        self._key = key
        count = len(PROJECTIONS)
        return [packs[i::count] for i in range(count)]
