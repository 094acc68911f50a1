"""The compiled float32 panel GEMM (a few dozen rows) against F.linear in float64, on every
ISA copy, and the engine's linear taking it for the rows it is meant for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import build
from plugserve.kernels import panel_gemm as pg
from plugserve.model.layers import linear

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


def _case(rows: int, n_in: int, n_out: int, bias: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    return x, w, b  # type: ignore[return-value]


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    # float32 sums of n_in products: within n_in * eps * |x||w| of the exact one.
    n_in = x.shape[1]
    return float(16 * n_in**0.5 * torch.finfo(torch.float32).eps * x.abs().max() * w.abs().max())


# rows cover every remainder of the 8-row (4-row on AVX2) tiles and several tiles; n_out
# covers partial panels (48 or 24 columns), a single column and more panels than threads;
# n_in covers odd sizes.
@pytest.mark.parametrize("rows", [1, 3, 9, 12, 17, 31, 64, 129])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (7, 5), (33, 1), (1536, 576), (64, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows: int, n_in: int, n_out: int, bias: bool) -> None:
    x, w, b = _case(rows, n_in, n_out, bias, seed=rows * 1000 + n_in + n_out)
    out = pg.panel_gemm(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (rows, n_out)
    torch.testing.assert_close(out.double(), ref, atol=_tolerance(x, w), rtol=0)


def test_strided_rows_and_empty_sums() -> None:
    x, w, b = _case(20, 100, 70, True, seed=5)
    wide = torch.randn(20, 130)
    wide[:, 10:110] = x
    view = wide[:, 10:110]  # rows 130 floats apart
    assert view.stride(0) == 130
    torch.testing.assert_close(pg.panel_gemm(view, w, b), pg.panel_gemm(x, w, b))
    # K = 0: the bias alone.
    empty = pg.panel_gemm(torch.empty(12, 0), torch.empty(70, 0), b)
    torch.testing.assert_close(empty, b.expand(12, 70))


def test_pack_follows_the_weight() -> None:
    x, w, _ = _case(16, 64, 50, False, seed=7)
    before = pg.panel_gemm(x, w, None)
    with torch.no_grad():
        w.mul_(2)  # written in place: the pack must be made again
    torch.testing.assert_close(pg.panel_gemm(x, w, None), before * 2)


def test_a_pack_of_another_width_is_refused() -> None:
    x, w, _ = _case(16, 64, 50, False, seed=8)
    packed = build.ops().panel_gemm_pack(w)
    width = packed.shape[2]
    wrong = torch.zeros(packed.shape[0], 64, width + 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        build.ops().panel_gemm(x, wrong, 50, None)


def _taken(rows: int, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the engine's linear runs `rows` float32 rows through the panel GEMM (and
    gets F.linear's result either way)."""
    x, w, b = _case(rows, 96, 200, True, seed=rows)
    calls: list[int] = []
    real = pg.panel_gemm

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(pg, "panel_gemm", counted)
    with torch.inference_mode():
        out = linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(out.double(), ref, atol=_tolerance(x, w), rtol=1e-6)
    return calls == [rows]


@pytest.mark.parametrize("rows", [pg.MIN_ROWS, 40, pg.MAX_ROWS_NARROW])
def test_engine_linear_takes_it(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _taken(rows, monkeypatch)


def test_more_rows_only_with_wide_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = build.ops().panel_gemm_width() >= pg.WIDE_PANEL
    assert _taken(pg.MAX_ROWS, monkeypatch) == wide


@pytest.mark.parametrize("rows", [pg.MIN_ROWS - 1, pg.MAX_ROWS + 1])
def test_engine_linear_leaves_other_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _case(rows, 96, 200, True, seed=rows)
    monkeypatch.setattr(pg, "panel_gemm", lambda *a: pytest.fail("panel GEMM taken"))
    with torch.inference_mode():
        linear(x, w, b)


def test_half_weights_take_it_only_without_native_half(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 rows of a bf16 weight: the panels (in bf16, widened in registers) where the copy in
    # use has no bf16 dot products, up to MAX_ROWS_HALF rows; elsewhere another kernel.
    from plugserve.kernels.packed_linear import half_is_native

    x, w, b = _case(40, 96, 200, True, seed=40)
    expect = not half_is_native(torch.bfloat16)
    assert pg.applies(x.bfloat16(), w.bfloat16()) == expect
    assert not pg.applies(torch.randn(pg.MAX_ROWS_HALF + 1, 96).bfloat16(), w.bfloat16())
    assert not pg.applies(x, w.bfloat16())  # x in another dtype than the weight
    calls: list[int] = []
    real = pg.panel_gemm
    monkeypatch.setattr(pg, "panel_gemm", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        out = linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert (calls == [1]) == expect and out.dtype == torch.bfloat16


# rows: one and two register tiles with a remainder, the largest half batch.
@pytest.mark.parametrize("rows", [3, 17, pg.MAX_ROWS_HALF])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_panels_match_float64(rows: int, w_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    # Panels packed in the weight's own dtype and widened as loaded (exact), float32 sums;
    # x in any float dtype, the result in x's dtype (rounded once).
    x, w, b = _case(rows, 576, 257, True, seed=rows)
    x, w = x.to(x_dtype), w.to(w_dtype)
    packed = build.ops().panel_gemm_pack(w)
    assert packed.dtype == w_dtype
    out = build.ops().panel_gemm(x, packed, 257, b)
    assert out.dtype == x_dtype and out.shape == (rows, 257)
    exact = F.linear(x.double(), w.double(), b.double())
    rounding = 0.0 if x_dtype == torch.float32 else torch.finfo(x_dtype).eps
    bound = exact.abs() * rounding + _tolerance(x.float(), w.float())
    assert ((out.double() - exact).abs() <= bound).all()
