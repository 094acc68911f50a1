"""The compiled decoder layer and stack with block-quantized projections (Q8_0, Q4_1, Q4_K,
and a fused qkv whose v rows are another format) against the op-by-op path, bit for bit, with
int8 and float activations, on every ISA copy this CPU runs; and, with float activations,
against torch in float64 over the dequantized weights."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from plugserve.kernels import decode_layer as dl
from plugserve.kernels import skinny_linear as sk
from plugserve.kernels.fused_elementwise import rms_norm_reference
from plugserve.model.rope import apply_rope
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations, dequantize
from tests.kernels.test_decode_layer import EPS, _copy, _plan, _randn, _rows
from tests.kernels.test_quant_linear import weight

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)

# (hidden, heads, kv heads, head_dim, intermediate): every projection's columns whole blocks
SMALL_SHAPE = (64, 4, 2, 16, 96)
K_SHAPE = (256, 4, 2, 64, 256)
# block formats of (q and k, v, o, gate_up, down)
LAYOUTS = {
    "q8_0": (SMALL_SHAPE, ("q8_0",) * 5),
    "q4_1": (SMALL_SHAPE, ("q4_1",) * 5),
    "q4_k_m": (K_SHAPE, ("q4_k", "q6_k", "q4_k", "q4_k", "q6_k")),
}
ACTIVATIONS: tuple[Activations, ...] = ("int8", "float")


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not dl.available():
        pytest.skip(f"decode_layer kernel unavailable: {dl.why_unavailable()}")


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if sk.takes_bf16() else [torch.float32]


def _layer(layout: str, bias: bool, dtype: torch.dtype, seed: int,
           activations: Activations) -> dl.LayerWeights:
    shape, (qk_f, v_f, o_f, gate_up_f, down_f) = LAYOUTS[layout]
    hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator().manual_seed(seed)
    qk_rows, v_rows = (heads + kv_heads) * head_dim, kv_heads * head_dim
    qkv: tuple[QuantBlocks, ...] = (weight(qk_f, qk_rows, hidden, seed),
                                    weight(v_f, v_rows, hidden, seed))
    if qk_f == v_f:  # one run of one format, as the loader merges it
        data = torch.cat([p.data for p in qkv])
        qkv = (QuantBlocks(qkv[0].qtype, data, qk_rows + v_rows, hidden),)

    def vector(n: int, base: float = 0.0) -> torch.Tensor:
        return (base + _randn(gen, n, scale=0.1)).to(dtype)

    return dl.LayerWeights(
        vector(hidden, 1.0), EPS, qkv, vector(qk_rows + v_rows) if bias else None, heads,
        kv_heads, head_dim, (weight(o_f, hidden, heads * head_dim, seed),),
        vector(hidden) if bias else None, vector(hidden, 1.0), EPS,
        (weight(gate_up_f, 2 * inter, hidden, seed),), vector(2 * inter) if bias else None,
        (weight(down_f, hidden, inter, seed),), vector(hidden) if bias else None, activations,
    )


def _dense(w: dl.ProjWeight) -> torch.Tensor:
    assert isinstance(w, tuple)
    return torch.cat([dequantize(p, torch.float64) for p in w])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_step_same_bits_as_the_op_by_op_path(
    layout: str, activations: Activations, dtype: torch.dtype, rows: int
) -> None:
    shape = LAYOUTS[layout][0]
    w = _layer(layout, rows == 3, dtype, rows, activations)
    r = _rows(shape, rows, dtype, seed=rows)
    qkv = w.attention_input(r["hidden"], r["cos"], r["sin"])
    ref_qkv = dl.attention_input_reference(
        r["hidden"], w.input_norm, EPS, w.qkv, w.qkv_bias, r["cos"], r["sin"],
        w.heads + w.kv_heads, w.head_dim, activations)
    assert qkv.dtype == dtype and torch.equal(qkv, ref_qkv)
    out = w.attention_output_and_mlp(r["attn"], r["hidden"])
    ref_out = dl.attention_output_and_mlp_reference(
        r["attn"], w.o, w.o_bias, r["hidden"], w.post_norm, EPS, w.gate_up, w.gate_up_bias,
        w.down, w.down_bias, activations)
    assert torch.equal(out, ref_out)
    plan = _plan(shape, rows, dtype, window=False)
    ref_plan = _copy(plan)
    step = w.decode_step(r["hidden"], r["cos"], r["sin"], plan)
    ref_step = w.decode_step(r["hidden"], r["cos"], r["sin"], ref_plan, reference=True)
    assert torch.equal(step, ref_step)
    assert torch.equal(plan.k_buffer, ref_plan.k_buffer)
    assert torch.equal(plan.v_buffer, ref_plan.v_buffer)


def _torch_float64(w: dl.LayerWeights, r: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (q and k rotated) and the layer's output, in float64 over the dequantized weights."""
    def lin(x: torch.Tensor, m: dl.ProjWeight, b: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, _dense(m), None if b is None else b.double())

    hidden = r["hidden"].double()
    qkv = lin(rms_norm_reference(hidden, w.input_norm.double(), EPS), w.qkv, w.qkv_bias)
    rotated = (w.heads + w.kv_heads) * w.head_dim
    qk = qkv[:, :rotated].view(qkv.shape[0], -1, w.head_dim)
    qk = apply_rope(qk, r["cos"].double()[:, None], r["sin"].double()[:, None])
    qkv = torch.cat((qk.flatten(1), qkv[:, rotated:]), dim=1)
    h = hidden + lin(r["attn"].double(), w.o, w.o_bias)
    gate, up = lin(rms_norm_reference(h, w.post_norm.double(), EPS), w.gate_up,
                   w.gate_up_bias).chunk(2, dim=-1)
    return qkv, h + lin(torch.nn.functional.silu(gate) * up, w.down, w.down_bias)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float_activations_match_torch_on_the_dequantized_weights(layout: str) -> None:
    shape = LAYOUTS[layout][0]
    w = _layer(layout, True, torch.float32, 5, "float")
    r = _rows(shape, 2, torch.float32, seed=5)
    want_qkv, want_out = _torch_float64(w, r)
    qkv = w.attention_input(r["hidden"], r["cos"], r["sin"])
    torch.testing.assert_close(qkv.double(), want_qkv, rtol=1e-4, atol=1e-4)
    out = w.attention_output_and_mlp(r["attn"], r["hidden"])
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_stack_of_quantized_and_dense_layers_equals_the_layers_one_by_one(
    activations: Activations,
) -> None:
    """A stack mixing quantized layers and a dense one runs each layer's `decode_step` in
    turn, bit for bit."""
    shape = SMALL_SHAPE
    hidden, heads, kv_heads, head_dim, inter = shape
    dtype = _dtypes()[-1]
    layers = [_layer("q4_1", True, dtype, 1, activations),
              _layer("q8_0", False, dtype, 2, activations)]
    gen = torch.Generator().manual_seed(3)
    dense = dict(qkv=_randn(gen, (heads + 2 * kv_heads) * head_dim, hidden, scale=0.1),
                 o=_randn(gen, hidden, heads * head_dim, scale=0.1),
                 gate_up=_randn(gen, 2 * inter, hidden, scale=0.1),
                 down=_randn(gen, hidden, inter, scale=0.1))
    layers.append(dl.LayerWeights(
        layers[0].input_norm, EPS, dense["qkv"].to(dtype), None, heads, kv_heads, head_dim,
        dense["o"].to(dtype), None, layers[0].post_norm, EPS, dense["gate_up"].to(dtype), None,
        dense["down"].to(dtype), None, activations,
    ))
    stack = dl.DecodeStack(layers)
    r = _rows(shape, 2, dtype, seed=4)
    plans = [_plan(shape, 2, dtype, window=i == 1) for i in range(3)]
    ref_plans = [_copy(plan) for plan in plans]
    out = stack.run(r["hidden"], r["cos"], r["sin"], plans)
    assert torch.equal(out, stack.run_reference(r["hidden"], r["cos"], r["sin"], ref_plans))
    for plan, ref_plan in zip(plans, ref_plans, strict=True):
        assert torch.equal(plan.k_buffer, ref_plan.k_buffer)


def test_quantized_parts_that_do_not_fit_are_refused() -> None:
    w = _layer("q4_1", False, torch.float32, 1, "int8")
    r = _rows(SMALL_SHAPE, 1, torch.float32, seed=1)
    (o,) = w.o
    short = (QuantBlocks(o.qtype, o.data[:, :-20], o.rows, o.cols - 32),)  # a block short
    with pytest.raises(RuntimeError, match="q4_1 blocks of 64 columns must be uint8"):
        dl.attention_output_and_mlp(r["attn"], short, None, r["hidden"], w.post_norm, EPS,
                                    w.gate_up, None, w.down, None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_stack_takes_decode_batches_bit_for_bit(
    layout: str, activations: Activations, dtype: torch.dtype
) -> None:
    """Past the few-row kernel a stack of quantized layers runs the many-row quantized path
    (AMX where it runs, else dequantize-and-GEMM) inside its one call: the same bits as the
    layers op by op, outputs and caches; a stack mixing a dense layer in takes no batch."""
    from tests.kernels.test_decode_stack_batch import _batch_plan, _copies

    shape = LAYOUTS[layout][0]
    stack = dl.DecodeStack([_layer(layout, seed == 1, dtype, seed, activations)
                            for seed in range(2)])
    for rows in (9, 24, 70):
        r = _rows(shape, rows, dtype, seed=rows)
        assert stack.takes_batch(r["hidden"])
        plans = [_batch_plan(shape, rows, dtype, window=i == 1, seed=rows + i)
                 for i in range(2)]
        ref_plans = _copies(plans)
        out = stack.run(r["hidden"], r["cos"], r["sin"], plans)
        ref = stack.run_reference(r["hidden"], r["cos"], r["sin"], ref_plans)
        assert out.dtype == dtype and torch.equal(out, ref)
        for plan, ref_plan in zip(plans, ref_plans, strict=True):
            assert torch.equal(plan.k_buffer, ref_plan.k_buffer)
            assert torch.equal(plan.v_buffer, ref_plan.v_buffer)
    assert not stack.takes_batch(_rows(shape, 8, dtype, seed=1)["hidden"])  # few rows
    last = stack.layers[1]
    dense = dataclasses.replace(last, qkv=_dense(last.qkv).to(dtype), o=_dense(last.o).to(dtype),
                                gate_up=_dense(last.gate_up).to(dtype),
                                down=_dense(last.down).to(dtype))
    mixed = dl.DecodeStack([stack.layers[0], dense])
    assert not mixed.takes_batch(_rows(shape, 24, dtype, seed=1)["hidden"])
