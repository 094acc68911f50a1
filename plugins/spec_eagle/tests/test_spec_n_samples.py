"""n > 1 with EAGLE: the samples fork the parent's cached prompt and each runs its own
speculative rounds; greedy samples equal plain greedy decoding, seeded samples equal the same
requests run one by one, the checker green after every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import NUM_STEPS, PROMPTS
from plugserve.sampling import SamplingParams, sample_seed
from plugserve.testing import EngineTest

CASES = [(1, 1, False), (16, 2, True)]  # (page_size, topk, overlap)


class TestSpecNSamples(EngineTest):
    @pytest.mark.parametrize(("page", "topk", "overlap"), CASES,
                             ids=["page1-topk1-normal", "page16-topk2-overlap"])
    def test_samples(self, target_dir: Path, random_head_dir: Path, page: int, topk: int,
                     overlap: bool) -> None:
        prompts = [PROMPTS[2], PROMPTS[3]]
        greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
        with self.engine(model=str(target_dir), page_size=page, overlap=overlap) as plain:
            want = [r.token_ids for r in plain.generate(prompts, greedy)]
        with self.engine(model=str(target_dir), page_size=page, overlap=overlap, spec="eagle",
                         draft_model=str(random_head_dir), spec_steps=NUM_STEPS,
                         spec_topk=topk) as engine:
            out = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                          n=3))
            together = engine.generate([prompts[1]], SamplingParams(
                max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=9, n=3))[0]
            alone = [engine.generate([prompts[1]], SamplingParams(
                max_new_tokens=12, ignore_eos=True, temperature=0.8,
                seed=sample_seed(9, j)))[0].token_ids for j in range(3)]
            self.assert_idle_memory_whole(engine)
        for res, w in zip(out, want, strict=True):
            assert [s.token_ids for s in res.samples] == [w] * 3
        assert [s.token_ids for s in together.samples] == alone
