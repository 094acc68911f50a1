"""The dense bf16 linear on AMX tiles against F.linear in float64 (bf16 tolerances), on
every ISA copy this CPU runs: the avx512_bf16 copy runs it where the CPU and OS have AMX,
every other copy (and a CPU without AMX) keeps oneDNN's packed matmul, which the model's
linear then uses."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import build, dense_amx
from plugserve.kernels import compile as compile_mod
from plugserve.kernels import isa as isa_mod
from plugserve.kernels.packed_linear import packed as onednn_packed
from plugserve.model.layers import linear
from plugserve.testing.conformance.threads import cpu_threads

BF16_EPS = float(torch.finfo(torch.bfloat16).eps)


def _skip_without_amx() -> None:
    if not dense_amx.amx_usable():
        pytest.skip("no AMX here: the CPU lacks AMX-BF16, the OS refused the tile state, or "
                    "this ISA copy was built without AMX")


def _inputs(rows: int, out: int, cols: int, bias: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).bfloat16()
    w = (torch.randn(out, cols, generator=gen) * cols**-0.5).bfloat16()
    b = torch.randn(out, generator=gen).bfloat16() if bias else None
    return x, w, b


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    # Exact products of bf16 pairs summed in float32, rounded once to bf16: within one bf16
    # rounding of the float64 result, plus float32 sums over K terms of size |x| |w|.
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    bound = BF16_EPS * exact.abs() + 1e-5 * scale + 1e-6
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    excess = (got.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} past the bound"


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize(("rows", "out", "cols", "bias"), [
    (9, 37, 64, False),  # fewest rows, one partial 16-row tile, one partial strip
    (16, 96, 576, True),
    (31, 70, 96, True),  # a partial 32-row block of more than 16 rows
    (32, 64, 1536, False),
    (57, 300, 160, True),  # whole and partial 32-row blocks
    (128, 33, 32, False),
    # Odd decode-batch rows: a tail of 1, 15, 17 or 31 rows after whole blocks, the tail from
    # its aligned copy and the whole blocks straight from x.
    (33, 64, 576, True),
    (47, 96, 192, False),
    (81, 40, 64, True),
    (95, 70, 96, False),
])
def test_matches_float64_within_bf16(rows: int, out: int, cols: int, bias: bool) -> None:
    _skip_without_amx()
    x, w, b = _inputs(rows, out, cols, bias, seed=rows + out)
    _check(dense_amx.dense_amx_linear(x, w, b), x, w, b)
    # Rows of x further apart than its columns (a slice of a wider tensor).
    wide = torch.cat([x, torch.ones_like(x)], dim=1)[:, :cols]
    _check(dense_amx.dense_amx_linear(wide, w, b), x, w, b)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize(("rows", "out", "cols", "bias"), [
    # Past MAX_ROWS the rows go in panels, an equal number per thread: one panel of 97 rows
    # per thread at most 2 threads, a partial last block (tail of 1), panels of 256 rows
    # (1,024 = 2 x 2 x 256), a tail of 31 in the last panel, a strip tail (N = 70).
    (97, 64, 64, True),
    (128, 70, 96, False),
    (300, 96, 576, True),
    (511, 40, 160, False),
    (1024, 96, 64, True),
    (1055, 64, 32, False),
])
def test_panels_of_many_rows_match_float64_within_bf16(rows: int, out: int, cols: int,
                                                      bias: bool) -> None:
    _skip_without_amx()
    x, w, b = _inputs(rows, out, cols, bias, seed=rows + out)
    results = []
    for threads in (1, 2, 3):
        with cpu_threads(threads):
            results.append(dense_amx.dense_amx_linear(x, w, b))
        _check(results[-1], x, w, b)
    # Each output element is one tile's sums over K in the same order, whatever the panels:
    # bit-equal across thread counts, and with x's rows further apart than its columns.
    assert all(torch.equal(r, results[0]) for r in results[1:])
    wide = torch.cat([x, torch.ones_like(x)], dim=1)[:, :cols]
    assert torch.equal(dense_amx.dense_amx_linear(wide, w, b), results[0])


@pytest.mark.usefixtures("kernel_isa")
def test_a_prefill_chunk_takes_the_panels_only_for_a_small_weight() -> None:
    x, w, b = _inputs(dense_amx.MAX_ROWS + 40, 64, 64, True, seed=5)
    with torch.inference_mode():
        out = linear(x, w, b)
    big = torch.zeros(dense_amx.PANEL_MAX_WEIGHT_BYTES // 2 // 64 + 32, 64, dtype=torch.bfloat16)
    assert not dense_amx.applies_many(x, big)  # past the bytes that stay in L2
    assert not dense_amx.applies(x, w)  # the decode-batch range ends at MAX_ROWS
    too_many = x.new_zeros(dense_amx.PANEL_MAX_ROWS + 1, 64)
    assert not dense_amx.applies_many(too_many, w)
    if dense_amx.amx_usable():
        assert dense_amx.applies_many(x, w)
        assert torch.equal(out, dense_amx.dense_amx_linear(x, w, b))
        _check(out, x, w, b)
    else:
        assert not dense_amx.applies_many(x, w)


@pytest.mark.usefixtures("kernel_isa")
def test_the_model_linear_takes_amx_where_it_runs_and_onednn_elsewhere() -> None:
    # Every ISA copy: the avx512_bf16 one with AMX takes the kernel, the others (as a CPU
    # without AMX) keep oneDNN's pack, bit for bit F.linear's bf16 path.
    x, w, b = _inputs(24, 80, 64, True, seed=3)
    with torch.inference_mode():
        out = linear(x, w, b)
    if dense_amx.amx_usable():
        assert dense_amx.applies(x, w)
        assert torch.equal(out, dense_amx.dense_amx_linear(x, w, b))
        _check(out, x, w, b)
    else:
        assert not dense_amx.applies(x, w)
        pack = onednn_packed(w)
        if pack is not None:
            assert torch.equal(out, pack(x, b))


def test_switched_off_or_out_of_range_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Switched off (PLUGSERVE_DENSE_AMX=0), the model's linear is oneDNN's pack again, as on
    # a CPU without AMX.
    x, w, b = _inputs(dense_amx.MIN_ROWS, 64, 64, True, seed=4)
    monkeypatch.setattr(dense_amx, "_ENABLED", False)
    assert not dense_amx.applies(x, w)
    assert not dense_amx.applies_many(x.repeat(dense_amx.MAX_ROWS, 1), w)
    pack = onednn_packed(w)
    if pack is not None:
        with torch.inference_mode():
            assert torch.equal(linear(x, w, b), pack(x, b))
    monkeypatch.setattr(dense_amx, "_ENABLED", True)
    few, many = x[: dense_amx.MIN_ROWS - 1], x.repeat(dense_amx.MAX_ROWS, 1)
    assert not dense_amx.applies(few, w) and not dense_amx.applies(many, w)
    assert not dense_amx.applies_many(many[:0], w)  # no rows
    assert not dense_amx.applies(x.float(), w.float())
    assert not dense_amx.applies(x[:, :48], w[:, :48])  # 48 input features: not 32-aligned


def test_the_pack_follows_in_place_writes_and_dies_with_the_weight() -> None:
    w = torch.nn.Parameter(torch.randn(40, 64).bfloat16(), requires_grad=False)
    first = dense_amx.packed(w)
    assert dense_amx.packed(w) is first
    assert first.numel() == 64 * 64  # 40 rows padded to two strips of 32
    with torch.no_grad():
        w.mul_(2)
    again = dense_amx.packed(w)
    assert again is not first and torch.equal(again, dense_amx.pack(w))
    key = id(w)
    del w, first, again
    gc.collect()
    assert key not in dense_amx._packs


def test_pack_puts_each_pair_where_the_tiles_read_it() -> None:
    # Weight row n, column k lands in strip n // 32, step k // 32, half (n % 32) // 16,
    # tile row (k % 32) // 2, pair n % 16, element k % 2.
    n_rows, cols = 45, 64
    w = torch.arange(n_rows * cols, dtype=torch.float32).reshape(n_rows, cols).bfloat16()
    p = dense_amx.pack(w).view(2, cols // 32, 2, 16, 16, 2)
    for n, k in [(0, 0), (1, 2), (17, 33), (44, 63), (31, 5)]:
        assert p[n // 32, k // 32, (n % 32) // 16, (k % 32) // 2, n % 16, k % 2] == w[n, k]
    assert p[1, :, 0, :, 13:].abs().sum() == 0 and p[1, :, 1].abs().sum() == 0  # padding
    with pytest.raises(ValueError, match="48 input features"):
        dense_amx.pack(torch.zeros(4, 48, dtype=torch.bfloat16))


def test_amx_is_used_where_the_cpu_has_it() -> None:
    # The build wiring: on a CPU with AMX-BF16 the avx512_bf16 copy has the dense kernel
    # (where the compiler takes the AMX flags).
    library = build.library()
    if library is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    if not isa_mod.has_cpu_flag("amx_bf16") or library.isa() != "avx512_bf16":
        pytest.skip(f"the CPU has no AMX-BF16 or the copy in use ({library.isa()}) has no AMX")
    opt = isa_mod.AMX_BF16_DENSE
    if not compile_mod.compiler_accepts((*isa_mod.by_name("avx512_bf16").flags, *opt.flags),
                                        opt.probe):
        pytest.skip("the compiler does not take the AMX flags")
    assert dense_amx.amx_usable()
