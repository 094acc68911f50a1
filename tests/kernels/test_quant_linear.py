"""The compiled quantized linear (few-row streaming kernel, the many-row path on AMX tiles, with
VNNI integer dot products and by dequantize-and-GEMM, block decoder) against the gguf-based
reference, for every kept block format, on every ISA copy this CPU runs (AVX2 and scalar
included on an AVX-512 machine)."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from plugserve.kernels import build
from plugserve.kernels import compile as compile_mod
from plugserve.kernels import isa as isa_mod
from plugserve.kernels import quant_linear as ql
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import (
    Activations,
    dequantize,
    quantize_activations_int8,
    reference_linear,
)
from plugserve.quant.types import KEPT_TYPES

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)

SMALL = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # 32-weight blocks gguf can quantize
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # 256-weight superblocks
FORMATS = SMALL + K_QUANTS
EPS32 = float(torch.finfo(torch.float32).eps)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not ql.available():
        pytest.skip("the CPU kernels are unavailable")


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


@functools.cache
def weight(name: str, rows: int, cols: int, seed: int = 0) -> QuantBlocks:
    """Random valid blocks: quantized random weights for the 32-block formats; for the
    K-quants random bytes with the fp16 d (and dmin) fields set to small finite values."""
    qtype = KEPT_TYPES[name]
    rng = np.random.default_rng(seed + rows * 7919 + cols)
    if name in SMALL:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32),
                                    qtype.ggml)
    else:
        blocks = rng.integers(0, 256, (rows, cols // 256, qtype.block_bytes), dtype=np.uint8)
        d = _fp16_bytes(rng.uniform(1e-3, 1e-2, (rows, cols // 256)))
        if name == "q6_k":
            blocks[..., 208:210] = d
        else:
            blocks[..., 0:2] = d
            blocks[..., 2:4] = _fp16_bytes(rng.uniform(1e-3, 1e-2, (rows, cols // 256)))
        data = blocks.reshape(rows, -1)
    return QuantBlocks(qtype, torch.from_numpy(np.ascontiguousarray(data)), rows, cols)


def _inputs(rows: int, cols: int, out: int, dtype: torch.dtype, bias: bool,
            seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen) if bias else None
    return x, b


def _check(out: torch.Tensor, x: torch.Tensor, w: QuantBlocks, b: torch.Tensor | None,
           activations: Activations, bf16_gemm: bool = False) -> None:
    """out against the float64 product of the reference's operands: within float32
    summation error of sum |x w|, plus one rounding to x's dtype when that is bf16 (and, for
    the many-row bf16 GEMM, whatever x's dtype: bf16 operands, 2^-8 of sum |x w|, and one
    rounding of the result to bf16)."""
    xr = (quantize_activations_int8(x) if activations == "int8" else x.float()).double()
    wd = dequantize(w).double()
    exact = xr @ wd.T + (0 if b is None else b.double())
    magnitude = xr.abs() @ wd.abs().T + (0 if b is None else b.double().abs())
    assert out.dtype == x.dtype and out.shape == exact.shape
    bound = 8 * EPS32 * w.cols**0.5 * magnitude + 1e-30
    if x.dtype == torch.bfloat16 or bf16_gemm:
        bound = bound + exact.abs() * 2.0**-8
    if bf16_gemm:
        bound = bound + magnitude * 2.0**-8
    err = (out.double() - exact).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {worst:.3g}x the bound"
    # and the reference function itself agrees with the same bound
    ref = reference_linear(x, w, b, activations).double()
    assert float(((ref - exact).abs() / (bound + exact.abs() * 2.0**-8)).max()) <= 1.0


def _cols(name: str) -> list[int]:
    # the small formats: one block, three, 17 (a pair loop's odd end), 18, 48
    return [256, 768] if name in K_QUANTS else [32, 96, 544, 576, 1536]


@pytest.mark.parametrize("name", FORMATS)
def test_decoder_matches_gguf_dequantize(name: str) -> None:
    for cols in _cols(name):
        w = weight(name, 13, cols)
        torch.testing.assert_close(ql.dequantize(w), dequantize(w), rtol=2e-7, atol=0)
        torch.testing.assert_close(ql.dequantize(w, torch.bfloat16),
                                   dequantize(w).bfloat16(), rtol=2.0**-8, atol=0)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_matches_reference(name: str, activations: Activations,
                                    dtype: torch.dtype) -> None:
    # x rows: one, odd, the default limit, past a 16-row pass; weight rows: one, odd (one
    # x row: four weight rows at a time and a remainder), more than a thread's grain;
    # columns: one block, a partial 256-chunk, SmolLM2's widths.
    for rows, out, bias in [(1, 1, False), (1, 301, True), (3, 37, True), (8, 7, False),
                            (17, 300, True)]:
        for cols in _cols(name):
            w = weight(name, out, cols)
            x, b = _inputs(rows, cols, out, dtype, bias, seed=rows + cols)
            _check(ql.few_rows(x, w, b, activations), x, w, b, activations)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_a_row_alone_equals_it_in_a_batch(name: str, activations: Activations) -> None:
    # One row of x goes through the one-row passes (four weight rows at a time, or one row:
    # Q8_0 on the avx2 copy), more rows through another loop; a row's sums are added in the
    # same order in both, so its outputs are the same bits alone or in a batch (what a
    # request's tokens must not depend on).
    cols = _cols(name)[-1]
    w = weight(name, 37, cols)
    x, b = _inputs(5, cols, 37, torch.float32, True, seed=11)
    together = ql.few_rows(x, w, b, activations)
    for i in range(x.shape[0]):
        assert torch.equal(ql.few_rows(x[i:i + 1], w, b, activations), together[i:i + 1]), i


def _skip_without_amx() -> None:
    if not ql.amx_available():
        pytest.skip("no AMX here: the CPU lacks AMX-BF16, the OS refused the tile state, or "
                    "this ISA copy was built without AMX")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ql.MANY_ROW_KERNELS)
def test_many_rows_matches_reference(name: str, activations: Activations,
                                     dtype: torch.dtype, kernels: str) -> None:
    # kernels: as the entry chooses (AMX where it runs, else VNNI or AVX2 for int8
    # activations), the VNNI kernel, the AVX2 one (int8; float activations fall to strips),
    # the dequantize-and-GEMM path alone. x rows: one, odd, past one and two 16-row tiles (up
    # to 64 rows x is AMX's B operand, past that the weight; VNNI packs x 16 rows a vector,
    # AVX2 8, two vectors a tile), a last 32-row block of more and of less than 16 rows; one
    # whole VNNI tile of rows against one whole 48-row panel; weight rows past whole panels
    # and strips.
    if kernels == "vnni":
        _skip_without_vnni()
    if kernels == "maddubs":
        _skip_without_maddubs()
    cases = [(1, 5, True), (9, 37, False), (33, 300, True), (47, 45, True), (91, 70, True),
             (300, 70, False), (32, 48, True), (64, 97, False)]
    for rows, out, bias in cases:
        cols = _cols(name)[-1]
        w = weight(name, out, cols)
        x, b = _inputs(rows, cols, out, dtype, bias, seed=rows)
        _check(ql.many_rows(x, w, b, activations, kernels), x, w, b, activations,
               _multiplies_in_bf16(activations, dtype, kernels))


def _multiplies_in_bf16(activations: Activations, dtype: torch.dtype, kernels: str) -> bool:
    """Whether the many-row path multiplies bf16 operands here (int8 activations or bf16 x):
    on AMX tiles, or through oneDNN where the copy in use multiplies bf16 natively. The VNNI
    kernel and the AVX2 one (int8 activations, no AMX) multiply exactly in integers and a copy
    without native bf16 products in float32: all held to the float32 bounds."""
    if activations == "float" and dtype == torch.float32:
        return False
    if kernels == "auto" and ql.amx_available():
        return True
    if activations == "int8" and kernels != "strips" and ql.vnni_available():
        return False
    if activations == "int8" and kernels in ("auto", "maddubs") and ql.maddubs_available():
        return False
    library = build.library()
    assert library is not None
    return library.bf16_dot


def _skip_without_vnni() -> None:
    if not ql.vnni_available():
        pytest.skip("no VNNI kernel here: the CPU lacks AVX512-VNNI or this ISA copy has no "
                    "AVX-512")


def _skip_without_maddubs() -> None:
    if not ql.maddubs_available():
        pytest.skip("no AVX2 integer kernel here: this ISA copy has no AVX2")


def _extreme_blocks(name: str, rows: int, cols: int) -> QuantBlocks:
    """Random bytes as blocks, row 0 all 0xFF (every quant at its top: 15 / 31 / 63, Q8_0 -1)
    and row 1 all 0x80 (Q8_0 -128), then the fp16 scale fields set to small values."""
    qtype = KEPT_TYPES[name]
    per = 32 if name in SMALL else 256
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (rows, cols // per, qtype.block_bytes), dtype=np.uint8)
    blocks[0] = 0xFF
    blocks[1] = 0x80
    d = _fp16_bytes(rng.uniform(1e-3, 1e-2, (rows, cols // per)))
    if name == "q6_k":
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2] = d
    if name in ("q4_1", "q5_1", "q4_k", "q5_k"):
        blocks[..., 2:4] = _fp16_bytes(rng.uniform(-1e-1, 1e-1, (rows, cols // per)))
    data = torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))
    return QuantBlocks(qtype, data, rows, cols)


@pytest.mark.parametrize("kernels", ["vnni", "maddubs"])
@pytest.mark.parametrize("name", FORMATS)
def test_integer_kernels_take_every_quant_value(name: str, kernels: str) -> None:
    # Every byte value in the blocks (quants -128 and 127 of Q8_0 included, which gguf's
    # quantizer never writes): each quant is shifted to an unsigned byte for vpdpbusd /
    # vpmaddubsw (Q8_0 on AVX2: |w| times x with w's sign) and the shift taken back out of
    # the integer sums exactly. x's first rows at +-127 in every block: against the weight
    # rows of top quants the AVX2 kernel's int16 sums reach their largest values (8 steps of
    # 2 x 15 x 127 for the 4-bit formats, 32,512 a pair for Q8_0) without saturating.
    if kernels == "vnni":
        _skip_without_vnni()
    else:
        _skip_without_maddubs()
    cols = 96 if name in SMALL else 512
    w = _extreme_blocks(name, 50, cols)
    for dtype in (torch.float32, torch.bfloat16):
        x, b = _inputs(40, cols, 50, dtype, True, seed=9)
        x[:4] = 1.0
        x[4:6] = -1.0
        x[6:8] = torch.where(x[6:8] < 0, -1.0, 1.0).to(dtype)
        _check(ql.many_rows(x, w, b, "int8", kernels), x, w, b, "int8")


@pytest.mark.parametrize("name", FORMATS)
def test_maddubs_has_the_vnni_kernels_bits(name: str) -> None:
    # The same x rounding, exact integer sums per group and float32 sums in the same order:
    # the AVX2 kernel's result equals the VNNI kernel's to the bit (x over four decades, so a
    # block's rounding through int8 matters), where both run.
    _skip_without_vnni()
    _skip_without_maddubs()
    cols = 96 if name in SMALL else 512
    w = weight(name, 70, cols)
    for dtype in (torch.float32, torch.bfloat16):
        x, b = _inputs(40, cols, 70, dtype, True, seed=3)
        x = x * torch.logspace(-2, 2, cols).to(dtype)
        assert torch.equal(ql.many_rows(x, w, b, "int8", "maddubs"),
                           ql.many_rows(x, w, b, "int8", "vnni"))


def test_auto_takes_vnni_where_there_is_no_amx() -> None:
    # The entry's choice on a CPU with AVX512-VNNI and no AMX: the VNNI kernel's bits.
    _skip_without_vnni()
    if ql.amx_available():
        pytest.skip("AMX takes the many rows here")
    w = weight("q4_k", 70, 512)
    x, b = _inputs(24, 512, 70, torch.float32, True, seed=6)
    assert torch.equal(ql.quant_linear(x, w, b, "int8"), ql.many_rows(x, w, b, "int8", "vnni"))


def test_auto_takes_maddubs_on_the_avx2_copy() -> None:
    # The entry's choice on the avx2 copy (no AMX, no VNNI there): the AVX2 integer kernel's
    # bits for a decode batch, and for Q8_0 only up to 128 rows (past them the float32 GEMM of
    # dequantized strips is as fast). The copies with AVX-512 leave it to VNNI or strips.
    library = build.library()
    assert library is not None
    if library.isa() != "avx2":
        pytest.skip(f"the automatic choice takes the AVX2 kernel on the avx2 copy only, "
                    f"not {library.isa()}")
    w = weight("q4_1", 70, 512)
    x, b = _inputs(24, 512, 70, torch.float32, True, seed=6)
    got = ql.quant_linear(x, w, b, "int8")
    assert torch.equal(got, ql.many_rows(x, w, b, "int8", "maddubs"))
    assert not torch.equal(got, ql.many_rows(x, w, b, "int8", "strips"))
    w8 = weight("q8_0", 70, 512)
    for rows, kernels in ((128, "maddubs"), (129, "strips")):
        x, b = _inputs(rows, 512, 70, torch.float32, True, seed=rows)
        assert torch.equal(ql.quant_linear(x, w8, b, "int8"),
                           ql.many_rows(x, w8, b, "int8", kernels)), rows


def test_many_rows_refuses_unknown_kernels() -> None:
    w = weight("q8_0", 8, 32)
    x, b = _inputs(9, 32, 8, torch.float32, False, seed=1)
    with pytest.raises(ValueError, match="kernels='amx'; allowed: auto, vnni, maddubs, strips"):
        ql.many_rows(x, w, b, "int8", "amx")


def test_many_rows_without_native_bf16_multiply_in_float32() -> None:
    # int8 activations of a float32 x, no AMX: on a copy without bf16 dot products (AVX2,
    # AVX-512 without AVX512-BF16) the product is float32, within float32 error of the exact
    # one; a bf16 product is ~2^-8 of sum |x w| off and fails the bound.
    library = build.library()
    assert library is not None
    if library.bf16_dot:
        pytest.skip(f"the copy in use ({library.isa()}) multiplies bf16 natively")
    w = weight("q4_1", 70, 576)
    x, b = _inputs(40, 576, 70, torch.float32, True, seed=11)
    _check(ql.many_rows(x, w, b, "int8", "strips"), x, w, b, "int8")


@pytest.mark.parametrize("name", ["q8_0", "q4_k"])
def test_many_rows_of_a_prefill_in_every_order(name: str) -> None:
    # Past 256 rows of x the AMX path dequantizes the whole weight and runs panels of x
    # against it; a weight of more than 2 MiB in bf16 (2,080 x 768 here) goes to the
    # dequantize-and-GEMM path instead. Both with a last partial panel and strip.
    _skip_without_amx()
    for out, cols in [(70, 512), (2080, 768)]:
        w = weight(name, out, cols)
        for dtype in (torch.float32, torch.bfloat16):
            x, b = _inputs(300, cols, out, dtype, True, seed=out)
            _check(ql.many_rows(x, w, b, "int8", "auto"), x, w, b, "int8", True)


@pytest.mark.parametrize("kernels", ql.MANY_ROW_KERNELS)
def test_many_rows_float_activations_keep_float32(kernels: str) -> None:
    # The float mode in float32 never goes through bf16, AMX or not (float32 error bounds).
    w = weight("q4_k", 45, 256)
    x, b = _inputs(19, 256, 45, torch.float32, True, seed=5)
    _check(ql.many_rows(x, w, b, "float", kernels), x, w, b, "float")


def test_amx_is_used_where_the_cpu_has_it() -> None:
    # The build wiring: on a CPU with AMX-BF16, the avx512_bf16 copy has the AMX kernel
    # (where the compiler takes the AMX flags).
    library = build.library()
    assert library is not None
    if "amx_bf16" not in isa_mod._cpu_flags() or library.isa() != "avx512_bf16":
        pytest.skip(f"the CPU has no AMX-BF16 or the copy in use ({library.isa()}) has no AMX")
    opt = isa_mod.AMX_BF16
    if not compile_mod.compiler_accepts((*isa_mod.by_name("avx512_bf16").flags, *opt.flags),
                                        opt.probe):
        pytest.skip("the compiler does not take the AMX flags")
    assert ql.amx_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_gemm_rounds_activations_as_the_reference(dtype: torch.dtype) -> None:
    # x through int8 per 32-block exactly as the reference rounds it (then to bf16), ties
    # included: a block whose max is 127 has scale 1, and its halves round to even.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=gen) * torch.logspace(-3, 3, 96)
    x[0, :32] = torch.arange(32) - 15.5
    x[0, 31] = 127.0
    x[1, 32:64] = 0.0
    x = x.to(dtype)
    for gemm_dtype in (torch.bfloat16, torch.float32):
        got = build.ops().quant_gemm_activations(x, True, gemm_dtype)
        assert got.dtype == gemm_dtype
        assert torch.equal(got, quantize_activations_int8(x).to(gemm_dtype))
        assert torch.equal(build.ops().quant_gemm_activations(x, False, gemm_dtype),
                           x.to(gemm_dtype))


def test_many_rows_strips_the_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # Strips of 16 float32 rows over 50 output rows: three whole strips and a partial one
    # (32-row strips in bf16); int8 activations too.
    monkeypatch.setattr(ql, "STRIP_BYTES", 16 * 96 * 4)
    w = weight("q4_1", 50, 96)
    for dtype in (torch.float32, torch.bfloat16):
        for activations in ("float", "int8"):
            x, b = _inputs(12, 96, 50, dtype, True, seed=4)
            _check(ql.many_rows(x, w, b, activations, "strips"), x, w, b, activations,
                   _multiplies_in_bf16(activations, dtype, "strips"))


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_entry_chooses_by_rows_and_keeps_leading_dims(activations: Activations) -> None:
    w = weight("q8_0", 40, 96)
    for rows in (1, ql.MAX_FEW_ROWS, ql.MAX_FEW_ROWS + 1):
        x, b = _inputs(rows, 96, 40, torch.float32, True, seed=rows)
        out = ql.quant_linear(x.reshape(1, rows, 96), w, b, activations)
        assert out.shape == (1, rows, 40)
        many = rows > ql.MAX_FEW_ROWS and _multiplies_in_bf16(activations, x.dtype, "auto")
        _check(out.reshape(rows, 40), x, w, b, activations, many)


def test_strided_rows_of_x_are_read_in_place() -> None:
    w = weight("q4_0", 24, 64)
    x, b = _inputs(3, 128, 24, torch.float32, False, seed=2)
    view = x[:, :64]  # rows 128 apart
    _check(ql.few_rows(view, w, b, "int8"), view.contiguous(), w, b, "int8")


def test_bad_input_is_refused_with_the_reason() -> None:
    w = weight("q4_0", 4, 64)
    with pytest.raises(ValueError, match="features"):
        ql.quant_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="activations"):
        ql.quant_linear(torch.randn(1, 64), w, activations="int4")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="unknown block format 'q3_k'"):
        ql.build.ops().quant_linear(torch.randn(1, 64), w.data, "q3_k", None, True)
    with pytest.raises(RuntimeError, match=r"uint8 \[rows, 36\]"):
        ql.build.ops().quant_linear(torch.randn(1, 64), w.data[:, :20], "q4_0", None, True)
