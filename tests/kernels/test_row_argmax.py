"""The compiled greedy reduction against torch.max(dim=-1)."""

from __future__ import annotations

import math

import pytest
import torch

from plugserve.kernels import row_argmax as ra

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not ra.available():
        pytest.skip(f"row_argmax kernel unavailable: {ra.why_unavailable()}")


def _assert_same(logits: torch.Tensor) -> None:
    maxes, ids = ra.row_argmax(logits)
    ref_maxes, ref_ids = ra.reference(logits)
    assert ids.dtype == torch.int64 and maxes.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert torch.equal(maxes.isnan(), ref_maxes.isnan())
    finite = ~ref_maxes.isnan()
    assert torch.equal(maxes[finite], ref_maxes[finite])


# Vocab sizes around the 16- and 64-value vector steps, and a real one.
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 63, 64, 65, 200, 49152])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_matches_torch_max(vocab: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab * 10 + rows)
    _assert_same(torch.randn(rows, vocab, generator=gen))


@pytest.mark.parametrize("vocab", [17, 130, 49152])
def test_ties_give_the_first_index(vocab: int) -> None:
    logits = torch.zeros(4, vocab)
    logits[0, [3, vocab - 1]] = 5.0  # two equal maxima
    logits[1] = 1.0  # all equal: index 0
    logits[2, -1] = 2.0  # in the tail
    logits[3, [vocab // 2, vocab // 2 + 1]] = float("inf")
    _assert_same(logits)
    assert ra.row_argmax(logits)[1].tolist()[:3] == [3, 0, vocab - 1]


@pytest.mark.parametrize("vocab", [17, 130, 49152])
def test_nan_and_infinite_rows(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, vocab // 3] = float("nan")
    logits[1, [1, vocab - 1]] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("-inf")
    logits[4, vocab - 1] = float("inf")
    maxes, ids = ra.row_argmax(logits)
    assert math.isnan(maxes[0]) and math.isnan(maxes[1])
    assert ids.tolist()[:3] == [vocab // 3, 1, 0]
    assert maxes[2].item() == float("-inf") and maxes[4].item() == float("inf")
    _assert_same(logits[2:])  # torch's index for a NaN row is its own business; the rest match


def test_strided_logits_and_bad_input() -> None:
    wide = torch.randn(3, 400, generator=torch.Generator().manual_seed(2))
    _assert_same(wide[:, ::2])
    assert ra.applies(wide) and not ra.applies(wide.double()) and not ra.applies(wide[0])
    with pytest.raises(RuntimeError, match="float32 CPU logits \\[rows, vocab\\]"):
        ra.row_argmax(wide.double())
    with pytest.raises(RuntimeError, match="the vocab dim is empty"):
        ra.row_argmax(torch.empty(2, 0))
