"""The fused CPU kernels (RMSNorm, residual add + RMSNorm, SiLU * up, rope) against their torch
references, and the layers that dispatch to them.

Tolerances: float32 within 1e-6 relative (the kernel sums squares in another order than
torch, so the norm's scale can sit an ulp or two of float32 apart). bfloat16 / float16:
at most 1% of the elements differ, each by at most 1 ulp of the dtype where the result is
rounded once (Gemma's norm), or 2 ulp where a rounded intermediate is multiplied again (the
Llama norm rounds x * r before the weight multiply, SiLU rounds before the up multiply: one
ulp apart there can become two in the product).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from plugserve.kernels import fused_elementwise as fe
from plugserve.model.layers import GatedMLP, RMSNorm

HALF = (torch.bfloat16, torch.float16)
EPS = 1e-6


pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module")
def kernel() -> None:
    if not fe.available():
        pytest.skip(f"fused_elementwise kernels unavailable: {fe.why_unavailable()}")


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as integers in the order of the values they stand for."""
    bits = t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    magnitude = bits & (0x7FFFFFFF if t.dtype == torch.float32 else 0x7FFF)
    return torch.where(bits < 0, -magnitude, magnitude)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, max_ulp: int) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0, equal_nan=True)
        return
    ulps = (_ordered(out) - _ordered(ref)).abs()
    assert int((ulps > max_ulp).sum()) == 0
    assert int((ulps > 0).sum()) <= 0.01 * ulps.numel()


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 576, 1000])
@pytest.mark.parametrize("rows", [0, 1, 65])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, rows: int, unit_offset: bool) -> None:
    x = _rand(rows, hidden, dtype=dtype, seed=hidden + rows, scale=3.0)
    w = _rand(hidden, dtype=dtype, seed=1)
    out = fe.rms_norm(x, w, EPS, unit_offset)
    _assert_matches(out, fe.rms_norm_reference(x, w, EPS, unit_offset), 1 if unit_offset else 2)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 576, 1000])
@pytest.mark.parametrize("rows", [0, 1, 65])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm(dtype: torch.dtype, hidden: int, rows: int, unit_offset: bool) -> None:
    x = _rand(rows, hidden, dtype=dtype, seed=hidden + rows)
    residual = _rand(rows, hidden, dtype=dtype, seed=hidden + rows + 1, scale=4.0)
    w = _rand(hidden, dtype=dtype, seed=2)
    normed, total = fe.add_rms_norm(x, residual, w, EPS, unit_offset)
    ref_normed, ref_total = fe.add_rms_norm_reference(x, residual, w, EPS, unit_offset)
    assert torch.equal(total, ref_total)  # one add, rounded once: exact
    _assert_matches(normed, ref_normed, 1 if unit_offset else 2)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 576, 1536])
@pytest.mark.parametrize("rows", [0, 1, 65])
def test_silu_mul(dtype: torch.dtype, width: int, rows: int) -> None:
    gate_up = _rand(rows, 2 * width, dtype=dtype, seed=width + rows, scale=4.0)
    out = fe.silu_mul(gate_up)
    _assert_matches(out, fe.silu_mul_reference(gate_up), 2)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_at_the_ends_of_the_range(dtype: torch.dtype) -> None:
    """exp(-gate) overflowing, underflowing into subnormals, infinities and NaN."""
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor(
        [-1e4, -120.0, -103.0, -88.8, -88.5, -87.4, -20.0, -1e-30, 0.0, -0.0, 1e-3, 20.0,
         88.8, 120.0, 6e4, inf, -inf, nan],
    )
    gate_up = torch.cat((gate, torch.linspace(-2.0, 3.0, len(gate)))).to(dtype)
    out = fe.silu_mul(gate_up[None])[0]
    ref = fe.silu_mul_reference(gate_up[None])[0]
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[~finite], ref[~finite], equal_nan=True, rtol=0, atol=0)
    # Rounded once per op from values within an ulp or two of float32's.
    torch.testing.assert_close(out[finite].float(), ref[finite].float(), rtol=1e-6, atol=1e-40)


@pytest.mark.usefixtures("kernel")
def test_silu_mul_over_every_bf16_gate_value() -> None:
    """Each of the 65,536 bf16 values as the gate (up = 1, then up = 3): the result is
    torch's, except that a subnormal SiLU(gate) may become zero (the AVX512-BF16 copy's
    rounding instruction flushes them) and at most a few values near a rounding midpoint are
    one ulp apart."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for up_value in (1.0, 3.0):
        gate_up = torch.cat((gate, torch.full_like(gate, up_value)))[None]
        out, ref = fe.silu_mul(gate_up)[0], fe.silu_mul_reference(gate_up)[0]
        both_nan = torch.isnan(out) & torch.isnan(ref)
        # Where SiLU(gate) is subnormal before its rounding (it may round up to the smallest
        # normal) or zero, the result may be zero.
        silu = torch.nn.functional.silu(gate.float())
        tiny = silu.abs() <= torch.finfo(torch.float32).tiny
        flushed = tiny & ((out == ref) | (out == 0))
        ulps = (_ordered(out) - _ordered(ref)).abs()
        apart = ~(both_nan | flushed) & (ulps > 0)
        assert int((ulps[~(both_nan | tiny)] > 1).sum()) == 0
        assert int(apart.sum()) <= 4, gate[apart].tolist()


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views_are_read_where_they_lie(dtype: torch.dtype) -> None:
    """The q heads split out of a fused q|k projection, a transposed tensor, a slice."""
    qk = _rand(5, 6 + 2, 64, dtype=dtype, seed=3)
    q = qk[:, :6]  # [tokens, heads, head_dim], rows not evenly spaced
    w = _rand(64, dtype=dtype, seed=4)
    _assert_matches(fe.rms_norm(q, w, EPS), fe.rms_norm_reference(q, w, EPS), 2)
    xt = _rand(64, 9, dtype=dtype, seed=5).t()  # the last dim strided: copied first
    _assert_matches(fe.rms_norm(xt, w, EPS), fe.rms_norm_reference(xt, w, EPS), 2)
    big = _rand(9, 3 * 40, dtype=dtype, seed=6)
    gate_up = big[1::2, 10:90]
    _assert_matches(fe.silu_mul(gate_up), fe.silu_mul_reference(gate_up), 2)
    normed, total = fe.add_rms_norm(q, qk[:, 2:], w, EPS)
    ref_normed, ref_total = fe.add_rms_norm_reference(q, qk[:, 2:], w, EPS)
    assert torch.equal(total, ref_total)
    _assert_matches(normed, ref_normed, 2)


@pytest.mark.usefixtures("kernel")
def test_bad_operands_are_errors() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        fe.rms_norm(x, torch.randn(7), EPS, False)
    with pytest.raises(RuntimeError, match="dtype differs"):
        fe.rms_norm(x, torch.randn(8, dtype=torch.bfloat16), EPS, False)
    with pytest.raises(RuntimeError, match="must be even"):
        fe.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        fe.silu_mul(torch.randn(3, 8, dtype=torch.float64))


def _layers(dtype: torch.dtype, activation: str = "silu") -> tuple[RMSNorm, RMSNorm, GatedMLP]:
    torch.manual_seed(7)
    norm = RMSNorm(48, EPS, dtype=dtype, device="cpu")
    gemma_norm = RMSNorm(48, EPS, dtype=dtype, device="cpu", unit_offset=True)
    mlp = GatedMLP(48, 80, bias=False, dtype=dtype, device="cpu", activation=activation)
    with torch.no_grad():
        for p in [*norm.parameters(), *gemma_norm.parameters(), *mlp.parameters()]:
            p.copy_(torch.randn_like(p) * 0.3)
    return norm, gemma_norm, mlp


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_use_the_kernels_in_inference(dtype: torch.dtype) -> None:
    norm, gemma_norm, mlp = _layers(dtype)
    x = _rand(11, 48, dtype=dtype, seed=8)
    residual = _rand(11, 48, dtype=dtype, seed=9)
    with torch.inference_mode():
        assert fe.applies(x, norm.weight)
        for layer in (norm, gemma_norm):
            max_ulp = 1 if layer.unit_offset else 2
            ref = fe.rms_norm_reference(x, layer.weight, EPS, layer.unit_offset)
            _assert_matches(layer(x), ref, max_ulp)
            normed, total = layer.add_and_norm(x, residual)
            assert torch.equal(total, residual + x)
            ref = fe.rms_norm_reference(total, layer.weight, EPS, layer.unit_offset)
            _assert_matches(normed, ref, max_ulp)
        # The down projection sums over the MLP width: bound its error by the output's scale.
        expected = mlp.down_proj(fe.silu_mul_reference(mlp.gate_up_proj(x))).float()
        step = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        atol = step * float(expected.abs().max())
        torch.testing.assert_close(mlp(x).float(), expected, rtol=0, atol=atol)


def test_training_takes_the_torch_path() -> None:
    """With gradients wanted the layers run the references, and backward works."""
    norm, gemma_norm, mlp = _layers(torch.float32)
    x = torch.randn(4, 48, requires_grad=True)
    assert not fe.applies(x, norm.weight)
    out = gemma_norm.add_and_norm(mlp(norm(x)), x)[0]
    out.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_gelu_mlp_keeps_the_torch_path() -> None:
    *_, mlp = _layers(torch.float32, activation="gelu_pytorch_tanh")
    x = torch.randn(4, 48)
    with torch.inference_mode():
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        assert torch.equal(mlp(x), mlp.down_proj(mlp.act(gate) * up))


def test_switched_off_by_the_environment() -> None:
    """PLUGSERVE_CPU_KERNELS=0: no kernel is built, the layers give the references' output."""
    script = """
import torch
from plugserve.kernels import fused_elementwise as fe
from plugserve.model.layers import RMSNorm
assert not fe.available() and fe.why_unavailable() == "PLUGSERVE_CPU_KERNELS=0"
norm = RMSNorm(16, 1e-6, dtype=torch.bfloat16, device="cpu")
with torch.no_grad():
    norm.weight.copy_(torch.randn(16))
x, r = torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16()
with torch.inference_mode():
    assert not fe.applies(x, norm.weight)
    assert torch.equal(norm(x), fe.rms_norm_reference(x, norm.weight, 1e-6))
    normed, total = norm.add_and_norm(x, r)
    assert torch.equal(total, r + x)
    assert torch.equal(normed, fe.rms_norm_reference(r + x, norm.weight, 1e-6))
print("ok")
"""
    env = {**os.environ, "PLUGSERVE_CPU_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (37, 4, 2, 128), (5, 3, 1, 10)])
def test_rope_in_place_is_the_reference_to_the_bit(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    from plugserve.model.rope import RotaryEmbedding, apply_rope

    # q and k heads as the model hands them over: a strided view into a fused qkv output.
    qkv = _rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=tokens + dim, scale=3.0)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None, dtype=dtype, device="cpu")
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    cos, sin = rotary(positions)
    expected = apply_rope(qk, cos, sin)
    fe.rope_(qk, cos, sin)
    # Every op rounds where torch's rounds and nothing is fused: identical bits, every dtype.
    assert torch.equal(qk.view(torch.int16 if dtype in HALF else torch.int32),
                       expected.view(torch.int16 if dtype in HALF else torch.int32))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v is left alone


@pytest.mark.usefixtures("kernel")
def test_rope_refuses_mismatched_angles() -> None:
    x = torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="4 contiguous values per token for 3 tokens"):
        fe.rope_(x, torch.randn(3, 1, 3), torch.randn(3, 1, 3))
    with pytest.raises(RuntimeError, match="dtype"):
        fe.rope_(x, torch.randn(3, 1, 4).bfloat16(), torch.randn(3, 1, 4).bfloat16())


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_copy_gives_the_avx512_copys_bits(dtype: torch.dtype, kernel_isa: str) -> None:
    """The plain loops vectorise on AVX2 as on AVX-512 (elementwise.cpp is compiled with
    -fno-trapping-math, which lets GCC turn their range and NaN selects into vector selects
    without AVX-512's masks) and the vectors change no value: the avx2 copy's SiLU * up,
    rope and residual sums are the avx512 copies' bits (both contract the same products into
    FMAs; the norms' sums of squares are added in an order that depends on the vector width,
    and the avx512_bf16 copy rounds bf16 its own way: both left out)."""
    from plugserve.kernels import compile as compile_mod
    from plugserve.kernels import isa as isa_mod

    assert "-fno-trapping-math" in compile_mod.SOURCE_FLAGS["elementwise.cpp"]
    names = [i.name for i in isa_mod.ladder()]
    wide = [n for n in ("avx512_vnni", "avx512") if n in names]
    if kernel_isa != "avx2" or not wide:
        pytest.skip("compares the avx2 copy with an avx512 / avx512_vnni copy of this CPU")
    special = torch.tensor([-1e4, -88.8, -88.5, -20.0, -0.0, 1e-3, 88.8, float("inf"),
                            float("-inf"), float("nan")])
    gate_up = _rand(37, 2 * 200, dtype=dtype, seed=8, scale=4.0)
    gate_up[0, : len(special)] = special.to(dtype)
    x, res = _rand(37, 200, dtype=dtype, seed=9), _rand(37, 200, dtype=dtype, seed=10)
    # add_rms_norm's residual sum h: elementwise
    w = _rand(200, dtype=dtype, seed=11)
    q = _rand(5, 3, 64, dtype=dtype, seed=12)
    cos, sin = _rand(5, 32, dtype=dtype, seed=13), _rand(5, 32, dtype=dtype, seed=14)

    def run() -> list[torch.Tensor]:
        qr = q.clone()
        fe.rope_(qr, cos, sin)
        return [fe.silu_mul(gate_up), fe.add_rms_norm(x, res, w, EPS)[1], qr]

    narrow = run()
    with isa_mod.use_isa(wide[0]):
        for i, (a, b) in enumerate(zip(narrow, run(), strict=True)):
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), i
