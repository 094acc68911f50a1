"""The holey layout (`plugserve.structs.holey_layout`) against a brute-force statement of DESIGN.md §5.

DESIGN.md §5: with `last = seq_len % page`, `base = seq_len - last` and `n` whole pages per
branch (enough for any prefix tail plus `num_steps` drafts), branch `t` owns
`[base + t*n*page, base + (t+1)*n*page)` and draft step `s` (0-based) of branch `t` writes
`base + t*n*page + last + s`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from plugserve.attention.draft_kv import holey_branch_positions
from plugserve.structs.holey_layout import HoleyLayout, branch_stride, pages_per_branch

PAGE_SIZES = [1, 4, 16]
TOPKS = [1, 2, 4]
STEPS = [1, 3, 5]
PREFIX_LENS = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 100]

CASES = list(itertools.product(PAGE_SIZES, STEPS, TOPKS))


def brute_pages(page: int, steps: int) -> int:
    """The fewest whole pages that hold the longest possible prefix tail plus the drafts."""
    return next(m for m in itertools.count(1) if m * page >= (page - 1) + steps)


def brute_positions(prefix: int, page: int, steps: int, topk: int) -> list[list[int]]:
    """positions[t][s] spelled out from DESIGN.md §5, one token at a time."""
    last = prefix % page
    base = prefix - last
    n = brute_pages(page, steps)
    return [[base + t * n * page + last + s for s in range(steps)] for t in range(topk)]


def brute_region(prefix: int, page: int, steps: int, branch: int) -> set[int]:
    base = prefix - prefix % page
    width = brute_pages(page, steps) * page
    return set(range(base + branch * width, base + (branch + 1) * width))


@pytest.mark.parametrize(("page", "steps", "topk"), CASES)
def test_positions_follow_the_design(page: int, steps: int, topk: int) -> None:
    layout = HoleyLayout(page, steps, topk)
    assert layout.pages_per_branch == pages_per_branch(page, steps) == brute_pages(page, steps)
    assert layout.stride == branch_stride(page, steps, topk) == brute_pages(page, steps) * page
    for prefix in PREFIX_LENS:
        expect = brute_positions(prefix, page, steps, topk)
        for t, s in itertools.product(range(topk), range(steps)):
            assert layout.draft_position(prefix, t, s) == expect[t][s]
        for s in range(steps):
            assert layout.step_positions(prefix, s) == [expect[t][s] for t in range(topk)]
        assert layout.branch_starts(prefix) == [min(brute_region(prefix, page, steps, t))
                                                for t in range(topk)]
        assert layout.tail_len(prefix) == prefix % page
        assert layout.base(prefix) + layout.tail_len(prefix) == prefix


@pytest.mark.parametrize(("page", "steps", "topk"), CASES)
def test_batch_tensor_matches_the_scalar_positions(page: int, steps: int, topk: int) -> None:
    layout = HoleyLayout(page, steps, topk)
    for step in range(steps):
        paths = layout.path_positions(PREFIX_LENS, step)
        assert paths.dtype == torch.int64
        assert paths.shape == (len(PREFIX_LENS), topk, step + 1)
        expect = [[row[: step + 1] for row in brute_positions(prefix, page, steps, topk)]
                  for prefix in PREFIX_LENS]
        assert paths.tolist() == expect
        # The attention contract's helper is the same layout.
        assert torch.equal(
            holey_branch_positions(PREFIX_LENS, topk=topk, step=step, num_steps=steps,
                                   page_size=page),
            paths,
        )


@pytest.mark.parametrize(("page", "steps", "topk"), CASES)
def test_branch_regions_never_overlap_and_hold_their_drafts(
    page: int, steps: int, topk: int
) -> None:
    layout = HoleyLayout(page, steps, topk)
    for prefix in PREFIX_LENS:
        regions = [set(layout.branch_region(prefix, t)) for t in range(topk)]
        for t in range(topk):
            assert regions[t] == brute_region(prefix, page, steps, t)
        for a, b in itertools.combinations(range(topk), 2):
            assert not regions[a] & regions[b], (prefix, a, b)
        for t in range(topk):
            region = layout.branch_region(prefix, t)
            drafts = [layout.draft_position(prefix, t, s) for s in range(steps)]
            assert set(drafts) <= regions[t]
            # The first `last` positions of every branch are the prefix tail (branch 0) or
            # its copy (the others); the drafts come right after them.
            assert drafts[0] == region.start + prefix % page
            # Every region is whole pages, aligned to the page.
            assert region.start % page == 0 and len(region) % page == 0
        # Nothing a round uses lies below the prefix's page-aligned base or past the footprint.
        used = set().union(*regions)
        assert min(used) == prefix - prefix % page
        assert max(used) == layout.footprint(prefix) - 1


@pytest.mark.parametrize(("page", "steps", "topk"), CASES)
def test_branch_zero_continues_the_prefix(page: int, steps: int, topk: int) -> None:
    layout = HoleyLayout(page, steps, topk)
    for prefix in PREFIX_LENS:
        assert [layout.draft_position(prefix, 0, s) for s in range(steps)] == list(
            range(prefix, prefix + steps)
        )
        if page == 1:  # no tail: branches simply follow one another
            assert layout.branch_starts(prefix) == [prefix + t * steps for t in range(topk)]


def test_out_of_range_steps_and_branches_are_refused() -> None:
    layout = HoleyLayout(4, 3, 2)
    with pytest.raises(ValueError, match=r"draft step 3 is outside 0\.\.2"):
        layout.draft_position(10, 0, 3)
    with pytest.raises(ValueError, match="draft step -1"):
        layout.step_positions(10, -1)
    with pytest.raises(ValueError, match="draft step 3"):
        layout.path_positions([10], 3)
    with pytest.raises(ValueError, match=r"branch 2 is outside 0\.\.1"):
        layout.draft_position(10, 2, 0)
    with pytest.raises(ValueError, match="topk must be at least 1"):
        HoleyLayout(4, 3, 0)
