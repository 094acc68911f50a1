"""The compiled CPU decode kernel against its reference (gather + SDPA in float32)."""

from __future__ import annotations

import pytest
import torch

from plugserve.kernels import paged_decode as pd
from plugserve.testing.conformance.threads import cpu_threads

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not pd.available():
        pytest.skip(f"paged_decode kernel unavailable: {pd.why_unavailable()}")


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, lens: list[int],
    window: int | None, seed: int,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 37
    k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    width = max(lens) + 3  # padding past every row's length
    # Each row's keys at shuffled slots, as a paged cache after churn leaves them.
    order = torch.randperm(num_slots, generator=gen)
    slots = torch.zeros(len(lens), width, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens):
        slots[i, :n] = order[start : start + n]
        start += n
    kv_lens = torch.tensor(lens, dtype=torch.int64)
    first = torch.zeros_like(kv_lens) if window is None else (kv_lens - window).clamp(min=0)
    return q, k, v, slots, first, kv_lens


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(4, 4, 64), (4, 2, 64), (9, 3, 64), (8, 2, 128), (10, 2, 256), (6, 3, 48)]
)
@pytest.mark.parametrize("window", [None, 5])
def test_matches_the_reference(
    dtype: torch.dtype, atol: float, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    case = _case(dtype, heads, kv_heads, dim, [1, 7, 30, 129], window, seed=heads * dim)
    out = pd.paged_decode(*case, scale=dim**-0.5)
    ref = pd.reference(*case, scale=dim**-0.5)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_reads_only_its_own_keys() -> None:
    """Slots outside [first_key, kv_len) hold garbage (NaN) that must not leak in."""
    q, k, v, slots, first, lens = _case(torch.float32, 4, 2, 64, [6, 11], 4, seed=1)
    expected = pd.reference(q, k, v, slots, first, lens, 0.125)
    used = {int(slots[i, j]) for i in range(2) for j in range(int(first[i]), int(lens[i]))}
    for s in range(k.shape[0]):
        if s not in used:
            k[s] = float("nan")
            v[s] = float("nan")
    out = pd.paged_decode(q, k, v, slots, first, lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)


def test_a_slot_outside_the_cache_is_an_error_not_a_read() -> None:
    q, k, v, slots, first, lens = _case(torch.float32, 4, 2, 64, [3], None, seed=2)
    slots[0, 1] = k.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        pd.paged_decode(q, k, v, slots, first, lens, 0.125)


@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("window", [None, 5])
def test_a_narrower_cache_under_float32_queries(kv_dtype: torch.dtype, window: int | None) -> None:
    """A bf16 or fp8 KV cache (widened to float32 as it is read) under float32 queries: the
    same as the reference over the same stored values."""
    q, k, v, slots, first, lens = _case(torch.float32, 8, 2, 128, [1, 7, 30, 129], window, 3)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = pd.paged_decode(q, k, v, slots, first, lens, 128**-0.5)
    ref = pd.reference(q, k, v, slots, first, lens, 128**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 600])
def test_long_rows_split_between_threads(
    threads: int, dtype: torch.dtype, atol: float, window: int | None
) -> None:
    """The keys of all rows are cut into one piece per thread, so a row's keys can be split
    between threads and their partial softmaxes merged: the same as the reference."""
    with cpu_threads(threads):
        case = _case(dtype, 9, 3, 64, [1500, 3, 700, 1], window, seed=threads)
        out = pd.paged_decode(*case, scale=0.125)
    ref = pd.reference(*case, scale=0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
