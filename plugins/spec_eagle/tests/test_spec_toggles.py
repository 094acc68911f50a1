"""The EAGLE fix toggles: each old behaviour fails its test, the fixed code passes it.

- spec_v2_bonus_preclaim: under the overlap loop, a round in flight claims its first slot
  when prepared; without that the committed length runs one behind the KV being written
  (the checker's committed rule catches it after the first overlapped round).
- page_tree_row_widen: without the wider rows the speculative reserve does not fit a row near
  the end of the context; the always-on row check names both numbers.
- prefix_tail_duplicate: with page_size > 1 and topk > 1, branches 1.. read the prefix's
  partial tail page from a copy in their own first page; without the copy they read stale
  slots and draft different trees than the same engine at page_size 1 does.
- spec_topk_busy_check_skip: the checker once skipped its busy-step check under topk > 1, so
  a leak that heals before idle went unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from doubles import OracleDrafter

from conftest import NUM_STEPS, PROMPTS, greedy
from plugserve.engine import Engine
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVAccountingError
from plugserve_spec_eagle.drafter import Drafter
from plugserve_spec_eagle.tree import DraftTree


def _spec(self: EngineTest, target: Path, head: Path, **kw: Any) -> Engine:
    cfg: dict[str, Any] = dict(model=str(target), dtype="float32", spec="eagle",
                               draft_model=str(head), spec_steps=NUM_STEPS)
    cfg.update(kw)
    return self.engine(**cfg)


class TestBonusPreclaim(EngineTest):
    def _run(self, target: Path, head: Path, long_reference: list[list[int]],
             reference: list[list[int]]) -> None:
        with _spec(self, target, head, overlap=True, page_size=4, spec_topk=2) as engine:
            engine.spec.drafter = OracleDrafter(  # type: ignore[union-attr]
                long_reference, num_steps=NUM_STEPS, topk=2,
                num_draft_tokens=engine.config.num_draft_tokens,
                vocab=engine.arch.vocab_size,
            )
            out = engine.generate(PROMPTS, greedy())
            assert [r.token_ids for r in out] == reference
            self.assert_idle_memory_whole(engine)

    def test_fixed(self, target_dir: Path, random_head_dir: Path,
                   long_reference: list[list[int]], reference: list[list[int]]) -> None:
        self._run(target_dir, random_head_dir, long_reference, reference)

    def test_reverted_fails(self, target_dir: Path, random_head_dir: Path,
                            long_reference: list[list[int]], reference: list[list[int]],
                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "spec_v2_bonus_preclaim")
        with pytest.raises(KVAccountingError, match=r"committed \d+ is off by -1"):
            self._run(target_dir, random_head_dir, long_reference, reference)


class TestRowWiden(EngineTest):
    """Requests that run to the end of a short context with a big tree reserve."""

    def _run(self, target: Path, head: Path) -> None:
        with _spec(self, target, head, page_size=16, spec_topk=4, context_len=96,
                   cache="none") as engine:
            out = engine.generate(PROMPTS[2:], greedy(200))
            assert all(r.finish_reason == "length" for r in out)
            assert all(r.prompt_tokens + r.output_tokens == engine.context_len for r in out)
            self.assert_idle_memory_whole(engine)

    def test_fixed(self, target_dir: Path, random_head_dir: Path) -> None:
        self._run(target_dir, random_head_dir)

    def test_reverted_fails(self, target_dir: Path, random_head_dir: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "page_tree_row_widen")
        with pytest.raises(RuntimeError, match=r"needs allocated length \d+ but its "
                                               r"req_to_token row is only \d+ slots wide"):
            self._run(target_dir, random_head_dir)


class _Recording:
    """Wraps a drafter and records every tree it proposes."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.trees: list[list[list[int]]] = []

    @property
    def kv_pools(self) -> Any:
        return self.inner.kv_pools

    def catch_up(self, batch: Any) -> None:
        self.inner.catch_up(batch)

    def draft(self, row_ids: Any, rows: Any, states: Any) -> DraftTree:
        tree = self.inner.draft(row_ids, rows, states)
        self.trees.append(tree.tokens.tolist())
        return tree


class TestPrefixTailDuplicate(EngineTest):
    """Page 16 must draft exactly the trees page 1 drafts (same head, same KV values)."""

    def _trees(self, target: Path, head: Path, page: int) -> list[list[list[int]]]:
        with _spec(self, target, head, page_size=page, spec_topk=4, cache="none",
                   chunked_prefill_size=0) as engine:
            assert engine.spec is not None
            recorder = _Recording(engine.spec.drafter)  # type: ignore[attr-defined]
            engine.spec.drafter = recorder  # type: ignore[attr-defined]
            engine.generate(PROMPTS, greedy())
            self.assert_idle_memory_whole(engine)
            return recorder.trees

    def test_fixed(self, target_dir: Path, random_head_dir: Path) -> None:
        assert self._trees(target_dir, random_head_dir, 16) == self._trees(
            target_dir, random_head_dir, 1
        )

    def test_reverted_fails(self, target_dir: Path, random_head_dir: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "prefix_tail_duplicate")
        assert self._trees(target_dir, random_head_dir, 16) != self._trees(
            target_dir, random_head_dir, 1
        )


class TestTopkBusyCheck(EngineTest):
    """A page taken from the pool outside any accounting for one step, then given back."""

    def _run_with_transient_leak(self, target: Path, head: Path) -> None:
        with _spec(self, target, head, page_size=4, spec_topk=2) as engine:
            sched = engine.scheduler
            original = sched.get_next_batch
            calls = {"n": 0}
            taken: list[int] = []

            def leaky() -> Any:
                calls["n"] += 1
                if taken:
                    sched.kv.allocator.free_pages.extend(taken)
                    taken.clear()
                if calls["n"] == 3:
                    pages = sched.kv.allocator.alloc_pages(1)
                    assert pages is not None
                    taken.extend(pages)
                return original()

            sched.get_next_batch = leaky  # type: ignore[method-assign]
            engine.generate(PROMPTS, greedy())
            self.assert_idle_memory_whole(engine)

    def test_fixed_catches_the_leak(self, target_dir: Path, random_head_dir: Path) -> None:
        with pytest.raises(KVAccountingError, match=r"off by -4"):
            self._run_with_transient_leak(target_dir, random_head_dir)

    def test_reverted_misses_it(self, target_dir: Path, random_head_dir: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "spec_topk_busy_check_skip")
        # The old checker says nothing: the leak healed before the idle check.
        self._run_with_transient_leak(target_dir, random_head_dir)
