"""The few-row linears split their weight rows between the threads by claims on shared
counters (kernels/work_share.h): which thread computes a row changes from call to call, what
the row is does not. With 2 and 3 threads, each call repeated, the outputs are bit-equal to
the single-thread output, on every ISA copy this CPU runs (AVX2 and scalar included on an
AVX-512 machine): row counts not a multiple of a claim, fewer rows than threads, one row.
A few-row decode stack call runs its kernels in one team (csrc/team.h): the same bits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch

from plugserve.kernels import decode_layer as dl
from plugserve.kernels import quant_linear as ql
from plugserve.kernels import skinny_linear as sk
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.quant.reference import Activations
from tests.kernels.test_decode_layer import EPS, SHAPES, _copy, _plan, _rows, _stack
from tests.kernels.test_decode_layer_quant import K_SHAPE, LAYOUTS, _layer
from tests.kernels.test_quant_linear import _check, weight

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)

THREADS = (2, 3)
REPEATS = 4  # calls per thread count: the split differs between calls


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not (ql.available() and sk.available() and dl.available()):
        pytest.skip("the CPU kernels are unavailable")


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _same_with_threads(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """run()'s output with one thread, after asserting every call with more is bit-equal."""
    torch.set_num_threads(1)
    one = run()
    for threads in THREADS:
        torch.set_num_threads(threads)
        for _ in range(REPEATS):
            out = run()
            assert torch.equal(out, one), f"{threads} threads changed the output"
    return one


# out rows: 1, fewer than the threads, not a multiple of the 4-row groups, several claims
# (a claim is ~16 KiB of weight) with a remainder.
@pytest.mark.parametrize("name,cols", [("q4_1", 576), ("q8_0", 64), ("q4_k", 1536)])
@pytest.mark.parametrize("out_rows", [1, 2, 5, 131, 1031])
@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("rows", [1, 3])
def test_quant_linear_rows_same_bits_with_any_threads(
    restore_threads: None, name: str, cols: int, out_rows: int, activations: Activations,
    rows: int,
) -> None:
    w = weight(name, out_rows, cols)
    gen = torch.Generator().manual_seed(out_rows + rows)
    x, b = torch.randn(rows, cols, generator=gen), torch.randn(out_rows, generator=gen)
    out = _same_with_threads(lambda: ql.few_rows(x, w, b, activations))
    _check(out, x, w, b, activations)


@pytest.mark.parametrize("n_in,n_out", [(576, 1), (576, 3), (64, 257), (1536, 1031)])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_rows_same_bits_with_any_threads(
    restore_threads: None, n_in: int, n_out: int, rows: int, dtype: torch.dtype
) -> None:
    if dtype == torch.bfloat16 and not sk.takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16: bf16 stays on the GEMM-library path")
    gen = torch.Generator().manual_seed(n_out + rows)
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    w = torch.randn(n_out, n_in, generator=gen).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype)
    out = _same_with_threads(lambda: sk.skinny_linear(x, w, b))
    ref = sk.reference(x.float(), w.float(), b.float())
    tol = 4 * n_in**0.5 * torch.finfo(torch.float32).eps * float(x.abs().max() * w.abs().max())
    step = 2**-8 if dtype == torch.bfloat16 else 0.0  # one rounding to bf16
    assert ((out.float() - ref).abs() <= ref.abs() * step + 4 * tol).all()


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_quantized_qkv_parts_same_bits_with_any_threads(
    restore_threads: None, activations: Activations
) -> None:
    """q and k in Q4_K, v in Q6_K: with int8 activations one split over both parts' rows."""
    w = _layer("q4_k_m", True, torch.float32, 0, activations)
    r = _rows(K_SHAPE, 1, torch.float32, seed=0)
    qkv = _same_with_threads(lambda: w.attention_input(r["hidden"], r["cos"], r["sin"]))
    ref = dl.attention_input_reference(
        r["hidden"], w.input_norm, EPS, w.qkv, w.qkv_bias, r["cos"], r["sin"],
        w.heads + w.kv_heads, w.head_dim, activations)
    assert torch.equal(qkv, ref)


@pytest.mark.parametrize("kind", ["float32", "q4_1", "q4_k_m"])
def test_stack_in_a_team_same_bits_with_any_threads(restore_threads: None, kind: str) -> None:
    """A few-row stack call with more than one thread is one team: the kernels' loops go to
    its waiting threads, which read the next projection's weights ahead in between. Its output
    equals the single-thread call's and the call with teams off, bit for bit, and the
    read-ahead ran; an error inside the team (a plan past its slot table) comes out as the
    kernel's error and the next call runs."""
    if kind == "float32":
        shape = SHAPES[1]
        stack = _stack([shape] * 3, torch.float32, post_eps=EPS)
    else:
        shape = LAYOUTS[kind][0]
        stack = dl.DecodeStack([_layer(kind, seed == 1, torch.float32, seed, "int8")
                                for seed in range(3)])
    r = _rows(shape, 1, torch.float32, seed=5)
    plans = [_plan(shape, 1, torch.float32, window=i == 2) for i in range(3)]

    def run(step_plans: list[PagedDecodePlan] = plans) -> torch.Tensor:
        return stack.run(r["hidden"], r["cos"], r["sin"], [_copy(p) for p in step_plans])

    before = dl.read_ahead_bytes()
    out = _same_with_threads(run)
    assert dl.read_ahead_bytes() > before
    torch.set_num_threads(2)
    previous = dl.set_team(False)
    try:
        off = dl.read_ahead_bytes()
        assert torch.equal(run(), out) and dl.read_ahead_bytes() == off
    finally:
        dl.set_team(previous)
    bad = list(plans)
    bad[1] = dataclasses.replace(plans[1], kv_lens=plans[1].kv_lens + 100)
    with pytest.raises(RuntimeError, match="exceeds the slot table's width"):
        run(bad)
    assert torch.equal(run(), out)
