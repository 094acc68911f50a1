"""Prompts sharing a long prefix: it is computed once, then reused from the radix cache,
also within one batch of simultaneous arrivals and while the first request still decodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy

PREFIX = [(7 * i + 3) % 250 + 2 for i in range(96)]
GROUPS = [[*PREFIX[:40], 200 + g, *PREFIX[40:]] for g in range(2)]


def _prompts() -> list[list[int]]:
    out = []
    for g, head in enumerate(GROUPS):
        for q in range(4):
            out.append([*head, 10 + g, 20 + q, 30 + q])
    return out


class TestSharedPrefix(EngineTest):
    @pytest.mark.parametrize("page", [1, 16])
    def test_prefix_computed_once_per_group(self, page: int, tiny_model_dir: Path) -> None:
        prompts = _prompts()
        sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir), page_size=page) as engine:
            out = engine.generate(prompts, sp)
            computed = engine.stats()["prefill_tokens"]
            self.assert_idle_memory_whole(engine)
        unique = sum(len(g) for g in GROUPS) + 3 * len(prompts)
        assert computed <= unique + len(prompts) * page, (computed, unique)
        assert [r.token_ids for r in out] == hf_greedy(tiny_model_dir, prompts, [6] * len(prompts))

    def test_chunked_prefix_is_not_computed_twice(self, tiny_model_dir: Path) -> None:
        # A 64-token budget splits the first prompt; its last chunk shares a batch with the
        # next prompt, which must wait for the rest of the prefix instead of computing it.
        prompts = [PREFIX[:60] * 2 + [10, 20 + q, 30 + q] for q in range(4)]
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir), chunked_prefill_size=64) as engine:
            out = engine.generate(prompts, sp)
            computed = engine.stats()["prefill_tokens"]
            self.assert_idle_memory_whole(engine)
        assert computed == 121 + 2 * len(prompts)
        assert [r.token_ids for r in out] == hf_greedy(tiny_model_dir, prompts, [4] * len(prompts))

    def test_no_cache_computes_everything(self, tiny_model_dir: Path) -> None:
        prompts = _prompts()
        sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        with self.engine(model=str(tiny_model_dir), cache="none") as engine:
            engine.generate(prompts, sp)
            assert engine.stats()["prefill_tokens"] == sum(len(p) for p in prompts)
