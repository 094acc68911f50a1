"""flashinfer_draft_indices_topk_factor (SGLang PR 27338): the old sizing fails, the fix holds.

A full batch (max_batch_size requests) drafting with topk 4 on long prefixes needs four page
lists per request. The persistent kv_indices buffer sized with the topk factor holds them
and the draft decode equals torch_native; sized without it (the toggle) the same batch needs
more page ids than the buffer has and stops with IndexBufferOverflow.
"""

from __future__ import annotations

import dataclasses

import pytest

from plugserve.testing.paged_cases import TOLERANCE, Cases, Shape, max_error, native, run_backend
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend
from plugserve_attention_flashinfer.buffers import IndexBufferOverflow
from plugserve_attention_flashinfer.fixes import DRAFT_INDICES_TOPK_FACTOR

TOPK = 4
PREFIXES = [37, 41]  # every request of the batch, near the end of its row


def _full_batch_draft_decode(
    cases: Cases, backend_reverts: frozenset[str] | None,
    context_reverts: frozenset[str] = frozenset(),
) -> None:
    shape = Shape(4)
    fb = cases.draft_decode(shape, PREFIXES, topk=TOPK, step=2, num_steps=3)
    ctx = shape.context(cases.device, max_batch_size=len(PREFIXES), spec_topk=TOPK)
    ctx = dataclasses.replace(ctx, revert_fixes=context_reverts)
    backend = FlashInferAttentionBackend(ctx, kernels=reference, revert_fixes=backend_reverts)
    q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim)
    got = run_backend(backend, fb, q, shape)
    assert max_error(got, native(fb, q, shape)) <= TOLERANCE[shape.dtype]


def test_fixed(cases: Cases) -> None:
    _full_batch_draft_decode(cases, frozenset())


def test_reverted_fails(cases: Cases) -> None:
    with pytest.raises(IndexBufferOverflow, match=r"needs \d+ page ids for 8 KV lists but its "
                       r"buffer holds \d+ \(max_batch_size \(reverted"):
        _full_batch_draft_decode(cases, frozenset({DRAFT_INDICES_TOPK_FACTOR}))


def test_reverted_through_the_engine_config(cases: Cases) -> None:
    """Without an explicit set the backend honours the engine's start-up choice, which the
    context carries (EngineConfig.revert_fixes, from PLUGSERVE_REVERT_FIX)."""
    with pytest.raises(IndexBufferOverflow):
        _full_batch_draft_decode(cases, None, context_reverts=frozenset({DRAFT_INDICES_TOPK_FACTOR}))
    _full_batch_draft_decode(cases, None)
