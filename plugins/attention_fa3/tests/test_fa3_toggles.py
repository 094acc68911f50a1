"""fa3_draft_page_scatter_oob (SGLang PR 27360): the old fill fails, the fix holds.

A topk>1 draft decode on pages of 4 whose prefixes end mid-page: every branch list starts its
branch chunk with the prefix's original tail slots, then the branch's own slots. One page per
chunk (the fix) gives each branch row the prefix's pages and then its own page, and the draft
decode equals torch_native. One column per distinct page (the toggle) also counts the
original tail page, so the row needs a column more than the step-tight table has: the row
reads the tail page where its own belongs, the extra page is scattered into the next row (or
past the table), and branches 1.. attend to the wrong KV.
"""

from __future__ import annotations

import dataclasses

import pytest

from plugserve.attention.draft_kv import DraftKVLists
from plugserve.testing.paged_cases import TOLERANCE, Cases, Shape, max_error, native, run_backend
from plugserve_attention_fa3 import reference
from plugserve_attention_fa3.backend import FA3AttentionBackend
from plugserve_attention_fa3.fixes import DRAFT_PAGE_SCATTER
from plugserve_attention_fa3.pages import distinct_page_lists

TOPK = 4
PREFIXES = [6, 13, 23]  # tails of 2, 1 and 3 tokens on pages of 4


def _draft_decode(
    cases: Cases, reverts: frozenset[str] | None,
    context_reverts: frozenset[str] = frozenset(),
) -> None:
    shape = Shape(4)
    fb = cases.draft_decode(shape, PREFIXES, topk=TOPK, step=1, num_steps=3, lists="core")
    ctx = shape.context(cases.device, max_batch_size=len(PREFIXES), spec_topk=TOPK)
    ctx = dataclasses.replace(ctx, revert_fixes=context_reverts)
    backend = FA3AttentionBackend(ctx, kernels=reference, revert_fixes=reverts)
    q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim)
    got = run_backend(backend, fb, q, shape)
    assert max_error(got, native(fb, q, shape)) <= TOLERANCE[shape.dtype]


def test_fixed(cases: Cases) -> None:
    _draft_decode(cases, frozenset())


def test_reverted_fails(cases: Cases) -> None:
    with pytest.raises(AssertionError):
        _draft_decode(cases, frozenset({DRAFT_PAGE_SCATTER}))


def test_reverted_scatter_writes_past_the_step_tight_row(cases: Cases) -> None:
    fb = cases.draft_decode(Shape(4), PREFIXES, topk=TOPK, step=1, num_steps=3, lists="core")
    lists = DraftKVLists.from_batch(fb)
    assert lists is not None
    entries = distinct_page_lists(lists.kv_indptr_cpu(), lists.kv_indices, 4)
    assert int(entries.column.max()) >= entries.width


def test_reverted_through_the_engine_config(cases: Cases) -> None:
    """Without an explicit set the backend honours the engine's start-up choice, which the
    context carries (EngineConfig.revert_fixes, from PLUGSERVE_REVERT_FIX)."""
    with pytest.raises(AssertionError):
        _draft_decode(cases, None, context_reverts=frozenset({DRAFT_PAGE_SCATTER}))
    _draft_decode(cases, None)
