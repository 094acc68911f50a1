"""Where a speculative round's draft tokens live in a request's row: the holey layout.

This is the one implementation of DESIGN.md §5's layout; the attention contract
(`plugserve.attention.draft_kv`) and spec plugins both use it.

A request with `prefix_len` committed (verified) tokens drafts `num_steps` steps on `topk`
branches. With `last = prefix_len % page_size` and `base = prefix_len - last`, every branch
owns `n = pages_per_branch(page_size, num_steps)` whole pages from `base`:

- branch `t` owns row positions `[base + t*stride, base + (t+1)*stride)`, `stride = n * page`;
- **draft step `s` (0-based: `0 <= s < num_steps`) of branch `t` writes row position
  `base + t*stride + last + s`.** This is the only step convention here.

Branch 0's first page is the prefix's partial tail page, so branch 0 simply continues the
prefix (draft step s at `prefix_len + s`). For every other branch the first `last` positions
of its first page are left for a copy of the prefix tail's KV (made by the spec plugin), so a
backend reading whole pages sees the real prefix. With page_size 1 there is no tail and the
branches follow one another: `prefix_len + t*num_steps + s`. With topk 1 only branch 0
exists (a chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def pages_per_branch(page_size: int, num_steps: int) -> int:
    """Whole pages each branch owns after the prefix's page-aligned base: enough for the
    prefix's partial tail (at most `page_size - 1` positions) plus `num_steps` drafts."""
    return -(-(page_size - 1 + num_steps) // page_size)


def branch_stride(page_size: int, num_steps: int, topk: int) -> int:
    """Row positions between the starts of two consecutive branches of one request (the
    width of each branch's region); see `HoleyLayout.stride`."""
    return HoleyLayout(page_size, num_steps, topk).stride


@dataclass(frozen=True)
class HoleyLayout:
    """The holey layout for one engine's `page_size`, `num_steps` and `topk` (see module)."""

    page_size: int
    num_steps: int
    topk: int

    def __post_init__(self) -> None:
        for field_name in ("page_size", "num_steps", "topk"):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"HoleyLayout.{field_name} must be at least 1, got {value}")

    @property
    def pages_per_branch(self) -> int:
        return pages_per_branch(self.page_size, self.num_steps)

    @property
    def stride(self) -> int:
        """Row positions between the starts of two consecutive branches (a branch's region
        width): `pages_per_branch * page_size`, which is `num_steps` at page_size 1."""
        return self.pages_per_branch * self.page_size

    def footprint(self, prefix_len: int) -> int:
        """One past the last row position any branch of a round may use."""
        return self.base(prefix_len) + self.topk * self.stride

    def tail_len(self, prefix_len: int) -> int:
        """`last`: how many prefix tokens sit on the prefix's partial last page."""
        return prefix_len % self.page_size

    def base(self, prefix_len: int) -> int:
        """The prefix's page-aligned base, where branch 0's region starts."""
        return prefix_len - self.tail_len(prefix_len)

    def branch_starts(self, prefix_len: int) -> list[int]:
        """First row position of each branch's region, branch 0 first."""
        base = self.base(prefix_len)
        return [base + t * self.stride for t in range(self.topk)]

    def branch_region(self, prefix_len: int, branch: int) -> range:
        """Row positions branch `branch` owns (its tail copy, its drafts and its padding)."""
        self._check_branch(branch)
        start = self.base(prefix_len) + branch * self.stride
        return range(start, start + self.stride)

    def draft_position(self, prefix_len: int, branch: int, step: int) -> int:
        """Row position draft step `step` (0-based) of branch `branch` writes."""
        self._check_branch(branch)
        self._check_step(step)
        return self.base(prefix_len) + branch * self.stride + self.tail_len(prefix_len) + step

    def step_positions(self, prefix_len: int, step: int) -> list[int]:
        """Row position draft step `step` (0-based) writes on each branch, branch 0 first."""
        self._check_step(step)
        last = self.tail_len(prefix_len)
        return [start + last + step for start in self.branch_starts(prefix_len)]

    def path_positions(
        self, prefix_lens: Sequence[int], step: int, *, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """int64 `[batch, topk, step + 1]`: row positions of draft steps `0..step` (0-based)
        of every branch of every request; `path[i, t, s] == draft_position(prefix_lens[i], t,
        s)`."""
        self._check_step(step)
        prefix = torch.tensor(list(prefix_lens), dtype=torch.int64, device=device)
        last = prefix % self.page_size
        starts = (prefix - last)[:, None] + torch.arange(
            self.topk, dtype=torch.int64, device=device
        )[None, :] * self.stride
        steps = torch.arange(step + 1, dtype=torch.int64, device=device)
        return (starts + last[:, None])[:, :, None] + steps[None, None, :]

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"draft step {step} is outside 0..{self.num_steps - 1}")

    def _check_branch(self, branch: int) -> None:
        if not 0 <= branch < self.topk:
            raise ValueError(f"branch {branch} is outside 0..{self.topk - 1}")
