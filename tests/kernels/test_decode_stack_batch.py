"""The decode stack over a decode batch past the few-row kernel (9 .. 96 rows): the same bits
as the op-by-op path (the bf16 AMX linear, the float32 panel GEMM), the KV store included;
its packs follow weight writes and ISA switches; rows no batch kernel takes are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.kernels import build, dense_amx
from plugserve.kernels import decode_batch as db
from plugserve.kernels import decode_layer as dl
from plugserve.kernels import isa as isa_mod
from plugserve.kernels import panel_gemm as panel
from plugserve.kernels.packed_linear import half_is_native
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.model import load_model
from tests.kernels.test_decode_layer import EPS, _layer, _model_logits, _rows
from tests.model.conftest import random_prompts, tiny_hf_model

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)

# (hidden, heads, kv heads, head_dim, intermediate), every width a multiple of the AMX tile's
# 32 inputs: a small shape, and the default model's.
SMALL, DEFAULT = (64, 4, 2, 16, 96), (576, 9, 3, 64, 1536)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not dl.available():
        pytest.skip(f"decode_layer kernel unavailable: {dl.why_unavailable()}")


def _stack(shape: tuple[int, ...], dtype: torch.dtype, layers: int = 2) -> dl.DecodeStack:
    _, heads, kv_heads, head_dim, _ = shape
    weights = []
    for seed in range(layers):
        p = _layer(shape, seed == 1, dtype, seed)
        weights.append(dl.LayerWeights(
            p["input_norm"], EPS, p["qkv_w"], p["qkv_b"], heads, kv_heads, head_dim, p["o_w"],
            p["o_b"], p["post_norm"], EPS * 2, p["gate_up_w"], p["gate_up_b"], p["down_w"],
            p["down_b"],
        ))
    return dl.DecodeStack(weights)


def _batch_plan(
    shape: tuple[int, ...], rows: int, dtype: torch.dtype, window: bool, seed: int
) -> PagedDecodePlan:
    """A cache holding random KV in which row i reads 1 + (7 i mod 23) scattered slots (each
    row its own context length), the last of them its new token's."""
    _, _, kv_heads, head_dim, _ = shape
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1 + (7 * i) % 23 for i in range(rows)], dtype=torch.int64)
    total = int(lens.sum()) + 5
    k_buffer = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen)
    slots = torch.zeros(rows, int(lens.max()), dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = order[start : start + n]
        start += n
    store_slots = slots[torch.arange(rows), lens - 1].clone()
    first_key = (lens - 4).clamp(min=0) if window else torch.zeros_like(lens)
    return PagedDecodePlan(k_buffer, v_buffer, store_slots, slots, first_key, lens, 0.3)


def _copies(plans: list[PagedDecodePlan]) -> list[PagedDecodePlan]:
    return [dataclasses.replace(p, k_buffer=p.k_buffer.clone(), v_buffer=p.v_buffer.clone())
            for p in plans]


def _batch_kernel_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the op-by-op path multiplies x by w with a batch kernel of the stack's."""
    return panel.applies(x, w) or dense_amx.applies(x, w)


def _check_run(stack: dl.DecodeStack, shape: tuple[int, ...], rows: int, dtype: torch.dtype,
               seed: int) -> torch.Tensor:
    """`stack.run` over `rows` rows equals `run_reference` (the op-by-op kernels), outputs and
    caches, bit for bit; returns the output."""
    r = _rows(shape, rows, dtype, seed=seed)
    plans = [_batch_plan(shape, rows, dtype, window=i == 1, seed=seed + i)
             for i in range(len(stack.layers))]
    ref_plans = _copies(plans)
    out = stack.run(r["hidden"], r["cos"], r["sin"], plans)
    ref = stack.run_reference(r["hidden"], r["cos"], r["sin"], ref_plans)
    assert out.dtype == dtype and out.shape == r["hidden"].shape
    assert torch.equal(out, ref)
    for plan, ref_plan in zip(plans, ref_plans, strict=True):
        assert torch.equal(plan.k_buffer, ref_plan.k_buffer)
        assert torch.equal(plan.v_buffer, ref_plan.v_buffer)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "rows"), [(SMALL, 9), (SMALL, 20), (SMALL, 57),
                                             (SMALL, 96), (DEFAULT, 24)])
def test_batch_rows_same_bits_as_the_op_by_op_path(
    dtype: torch.dtype, shape: tuple[int, ...], rows: int
) -> None:
    stack = _stack(shape, dtype)
    r = _rows(shape, rows, dtype, seed=rows)
    takes = _batch_kernel_runs(r["hidden"], stack.layers[0].qkv)  # type: ignore[arg-type]
    # float32: the panel GEMM on every ISA copy; bf16: the AMX linear where AMX runs, the
    # bf16 panels where the copy in use has no bf16 dot products
    assert stack.takes_batch(r["hidden"]) == takes
    assert takes == (dtype == torch.float32 or dense_amx.amx_usable()
                     or (rows <= panel.MAX_ROWS_HALF and not half_is_native(torch.bfloat16)))
    if not takes:
        plans = [_batch_plan(shape, rows, dtype, False, i) for i in range(2)]
        with pytest.raises(ValueError, match=f"{rows} rows of torch.bfloat16 are past"):
            stack.run(r["hidden"], r["cos"], r["sin"], plans)
        return
    # the first run of these new weights: it takes the packs from the kernel's own cache
    stack.run(r["hidden"], r["cos"], r["sin"],
              [_batch_plan(shape, rows, dtype, False, i) for i in range(2)])
    library = build.library()
    assert library is not None
    cache = dense_amx._packs if stack._batch.kind == "amx" else panel._packs[library.isa()]
    for layer in stack.layers:
        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert id(weight) in cache and cache[id(weight)][1]() is weight
    _check_run(stack, shape, rows, dtype, seed=rows)


def test_rows_past_the_batch_kernels_are_not_taken() -> None:
    stack32, stack16 = _stack(SMALL, torch.float32), _stack(SMALL, torch.bfloat16)
    library = build.library()
    assert library is not None
    panel_rows = panel.MAX_ROWS if panel._panel_width(library.isa()) >= panel.WIDE_PANEL \
        else panel.MAX_ROWS_NARROW
    assert stack32.takes_batch(_rows(SMALL, panel_rows, torch.float32, 1)["hidden"])
    assert not stack32.takes_batch(_rows(SMALL, panel_rows + 1, torch.float32, 1)["hidden"])
    half_rows = dense_amx.MAX_ROWS if stack16._batch.kind == "amx" else panel.MAX_ROWS_HALF
    assert not stack16.takes_batch(_rows(SMALL, half_rows + 1, torch.bfloat16, 1)["hidden"])
    # a bf16 layer whose inputs are not a multiple of 32 has no AMX batch path (the bf16
    # panels take it where the copy has no bf16 dot products)
    assert _stack((40, 4, 2, 10, 56), torch.bfloat16).takes_batch(
        _rows((40, 4, 2, 10, 56), 20, torch.bfloat16, 1)["hidden"]
    ) == (not half_is_native(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packs_follow_weight_writes_and_isa_switches(dtype: torch.dtype) -> None:
    """After an in-place weight write the stack runs on the new values (a new pack); on
    every other ISA copy it runs on that copy's packs (the panel width differs)."""
    stack = _stack(SMALL, dtype)
    if not stack.takes_batch(_rows(SMALL, 16, dtype, 1)["hidden"]):
        pytest.skip("no batch kernel for bf16 on this ISA copy (no AMX)")
    before = _check_run(stack, SMALL, 16, dtype, seed=3)
    with torch.no_grad():
        stack.layers[1].gate_up.mul_(2)  # type: ignore[union-attr]
    after = _check_run(stack, SMALL, 16, dtype, seed=3)
    assert not torch.equal(before, after)
    library = build.library()
    assert library is not None
    for name in library.isas():
        with isa_mod.use_isa(name):
            if stack.takes_batch(_rows(SMALL, 16, dtype, 1)["hidden"]):
                _check_run(stack, SMALL, 16, dtype, seed=4)


def _batch_decode_through_the_stack(
    monkeypatch: pytest.MonkeyPatch, model: Any, seed: int, takes: bool
) -> None:
    """The model's decode steps over 12 requests (different context lengths) give the same
    logits through the stack's batch path as through the layers op by op, and every decode
    step is one stack call where `takes` (none otherwise)."""
    prompts = random_prompts([2 + i % 5 for i in range(12)], seed=seed)
    rows = 0
    real_run = dl.DecodeStack.run

    def counting(self: dl.DecodeStack, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        nonlocal rows
        rows += hidden.shape[0]
        return real_run(self, hidden, *args)

    monkeypatch.setattr(dl.DecodeStack, "run", counting)
    stacked = _model_logits(model, prompts)
    assert rows == (3 * len(prompts) if takes else 0)
    monkeypatch.setattr(db, "_ENABLED", False)
    op_by_op = _model_logits(model, prompts)
    assert rows == (3 * len(prompts) if takes else 0)
    for ours, ref in zip(stacked, op_by_op, strict=True):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_batch_decode_equals_the_op_by_op_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A tiny model: where the batch kernels take the rows (float32; bf16 on AMX, or in bf16
    panels where the copy has no bf16 dot products)."""
    tiny_hf_model("llama3_rope_bias", tmp_path)
    model = load_model(str(tmp_path), dtype=dtype, device="cpu").model
    takes = (dtype == torch.float32 or dense_amx.amx_usable()
             or not half_is_native(torch.bfloat16))
    _batch_decode_through_the_stack(monkeypatch, model, 8, takes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_batch_decode_equals_the_op_by_op_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The same with every projection quantized on load (Q8_0, int8 activations): the stack
    takes every decode batch (the many-row quantized path needs no pack)."""
    tiny_hf_model("llama3_rope_bias", tmp_path)
    model = load_model(str(tmp_path), dtype=dtype, device="cpu", quantization="q8_0").model
    assert all(isinstance(getattr(w, name), tuple) for w in
               (layer.decode_weights() for layer in model.decoder_layers)
               for name in ("qkv", "o", "gate_up", "down"))
    _batch_decode_through_the_stack(monkeypatch, model, 9, True)
