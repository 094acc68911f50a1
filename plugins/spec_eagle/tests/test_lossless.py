"""Lossless: greedy output with EAGLE speculation equals greedy output without it.

Matrix: backend × page_size {1, 4, 16} × topk {1, 2, 4} × normal/overlap loop × radix/none
× chunked prefill on/off, with three drafts:
- an oracle that always proposes the target's own continuation: every round must accept all
  `num_steps` draft tokens plus the bonus (so verify, the tree mask and the accepted-KV move
  are exact);
- a random draft (nearly everything rejected: rejected KV must not leak into the output);
- a trained tiny EAGLE head (the real drafting path: draft KV, branch pages, tail copies).
The checker runs at level 1 throughout, and memory is whole at idle after each run.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from doubles import OracleDrafter, RandomDrafter

from conftest import MAX_NEW, NUM_STEPS, PROMPTS, greedy
from plugserve.engine import Engine
from plugserve.testing import EngineTest

PAGES = (1, 4, 16)
TOPKS = (1, 2, 4)
LOOPS = ("normal", "overlap")
CACHES = ("radix", "none")
CHUNKS = (0, 16)

FULL = list(itertools.product(PAGES, TOPKS, LOOPS, CACHES, CHUNKS))
# Every page x topk x loop, with cache and chunking rotating through their four combinations.
COVER = [
    (page, topk, loop, *list(itertools.product(CACHES, CHUNKS))[i % 4])
    for i, (page, topk, loop) in enumerate(itertools.product(PAGES, TOPKS, LOOPS))
]


def _ids(case: tuple[Any, ...]) -> str:
    page, topk, loop, cache, chunk = case
    return f"page{page}-topk{topk}-{loop}-{cache}-chunk{chunk}"


class SpecMatrix(EngineTest):
    attention = "torch_native"

    def spec_engine(self, target_dir: Path, head_dir: Path, case: tuple[Any, ...]) -> Engine:
        page, topk, loop, cache, chunk = case
        return self.engine(
            model=str(target_dir), dtype="float32", attention=self.attention, cache=cache,
            page_size=page, chunked_prefill_size=chunk, overlap=loop == "overlap",
            spec="eagle", draft_model=str(head_dir), spec_steps=NUM_STEPS, spec_topk=topk,
        )

    def run_case(self, engine: Engine, reference: list[list[int]]) -> list[dict[int, int]]:
        results = engine.generate(PROMPTS, greedy())
        assert [r.token_ids for r in results] == reference
        self.assert_idle_memory_whole(engine)
        # Run again: the second pass starts from a warm prefix cache.
        again = engine.generate(PROMPTS, greedy())
        assert [r.token_ids for r in again] == reference
        self.assert_idle_memory_whole(engine)
        return [r.stats["spec_accept_hist"] for r in results + again]


class TestOracleDraft(SpecMatrix):
    @pytest.mark.parametrize("case", FULL, ids=_ids)
    def test_every_draft_token_accepted(
        self, case: tuple[Any, ...], target_dir: Path, random_head_dir: Path,
        reference: list[list[int]], long_reference: list[list[int]],
    ) -> None:
        with self.spec_engine(target_dir, random_head_dir, case) as engine:
            engine.spec.drafter = OracleDrafter(  # type: ignore[union-attr]
                long_reference, num_steps=NUM_STEPS, topk=case[1],
                num_draft_tokens=engine.config.num_draft_tokens,
                vocab=engine.arch.vocab_size,
            )
            hists = self.run_case(engine, reference)
        rounds = -(-(MAX_NEW - 1) // (NUM_STEPS + 1))
        assert hists == [{NUM_STEPS + 1: rounds}] * len(hists)


class TestRandomDraft(SpecMatrix):
    @pytest.mark.parametrize("case", COVER, ids=_ids)
    def test_rejections_are_lossless(
        self, case: tuple[Any, ...], target_dir: Path, random_head_dir: Path,
        reference: list[list[int]],
    ) -> None:
        with self.spec_engine(target_dir, random_head_dir, case) as engine:
            engine.spec.drafter = RandomDrafter(  # type: ignore[union-attr]
                num_steps=NUM_STEPS, topk=case[1],
                num_draft_tokens=engine.config.num_draft_tokens,
                vocab=engine.arch.vocab_size, seed=case[0] * 10 + case[1],
            )
            hists = self.run_case(engine, reference)
        # Random tokens from the vocabulary are (almost) never what the target wants.
        rounds = sum(sum(h.values()) for h in hists)
        assert sum(h.get(1, 0) for h in hists) >= 0.9 * rounds


class TestTrainedHead(SpecMatrix):
    @pytest.mark.parametrize("case", COVER, ids=_ids)
    def test_trained_head_is_lossless(
        self, case: tuple[Any, ...], target_dir: Path, trained_head_dir: Path,
        reference: list[list[int]],
    ) -> None:
        with self.spec_engine(target_dir, trained_head_dir, case) as engine:
            hists = self.run_case(engine, reference)
        accepted = sum(n * (length - 1) for h in hists for length, n in h.items())
        assert accepted > 0, f"the trained head never got a draft token accepted: {hists}"
