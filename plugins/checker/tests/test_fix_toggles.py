"""Each core fix toggle: the old behaviour fails the test, the fixed code passes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.engine import Engine
from plugserve.mem.manager import KVManager
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_checker.errors import KVAccountingError, KVCorruptionError

LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(13 * j + 7 * i) % 200 + 3 for j in range(length + 3 * i)] for i in range(n)]


def _staggered(engine: Engine) -> None:
    """Decodes running while a new prefill batch arrives: last batch != running batch."""
    sched = engine.scheduler
    for p in _prompts(3, 8):
        engine.submit(p, LONG)
    for _ in range(3):
        sched.step()
    for p in _prompts(2, 12):
        engine.submit(p, LONG)
    while sched.step():
        pass
    sched.settle_idle()


class TestBatchIdentity(EngineTest):
    def test_fixed(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            _staggered(engine)
            self.assert_idle_memory_whole(engine)

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "batch_identity")
        with self.engine(model=str(tiny_model_dir)) as engine, pytest.raises(
            RuntimeError, match=r"Boolean value of Tensor|must match the size|off by"
        ):
            # Comparing batches field by field compares their tensors: it raises (or, for
            # one-request batches, may drop the running batch from the sum).
            _staggered(engine)


def _overallocating_decode(extra_slots: int) -> Any:
    """Test double for a speculative decoder: each decode reserves `extra_slots` more slots
    than it commits (the over-allocation a draft tree leaves behind)."""
    original = KVManager.claim_decode

    def claim_decode(kv: KVManager, req: Any) -> int:
        slot = original(kv, req)
        if req.kv_allocated_len == req.kv_committed_len:
            kv.reserve(req, req.kv_allocated_len + extra_slots)
        return slot

    return claim_decode


class TestFinishOverallocUnaligned(EngineTest):
    env = {"PLUGSERVE_PAGE_SIZE": "4", "PLUGSERVE_CACHE": "none"}

    def _run(self, engine: Engine) -> None:
        engine.generate(_prompts(2, 6), SamplingParams(max_new_tokens=3, ignore_eos=True))

    def test_fixed(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(KVManager, "claim_decode", _overallocating_decode(6))
        with self.engine(model=str(tiny_model_dir)) as engine:
            self._run(engine)
            self.assert_idle_memory_whole(engine)

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(KVManager, "claim_decode", _overallocating_decode(6))
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "finish_overalloc_unaligned")
        with self.engine(model=str(tiny_model_dir)) as engine:
            with pytest.raises(KVAccountingError, match="off by \\+"):
                self._run(engine)  # the tail page is freed twice


class TestRetractNoReset(EngineTest):
    env = {"PLUGSERVE_KV_POOL_TOKENS": "96"}

    def test_fixed(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            engine.generate(_prompts(4, 10), LONG)
            assert engine.stats()["retracted_reqs"] > 0
            self.assert_idle_memory_whole(engine)

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "retract_no_reset")
        with self.engine(model=str(tiny_model_dir)) as engine:
            with pytest.raises(RuntimeError, match="a retract must reset its lengths"):
                engine.generate(_prompts(4, 10), LONG)


def _fork_then_abort_parent(engine: Engine) -> None:
    """Three samples fork the parent's cached prompt; then the parent is aborted, so only the
    samples' own locks keep the prompt's pages from being evicted."""
    prompt = [(11 * i + 5) % 240 + 3 for i in range(40)]
    parent = engine.submit(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, n=3))
    for _ in range(3):
        engine.step()
    assert all(r.req_pool_idx is not None for r in parent.group)  # all forked and running
    engine.abort(parent)
    for _ in range(100):
        if not engine.step() and engine.is_idle():
            break


class TestForkWithoutLock(EngineTest):
    env = {"PLUGSERVE_PAGE_SIZE": "4"}

    def test_fixed(self, tiny_model_dir: Path) -> None:
        with self.engine(model=str(tiny_model_dir)) as engine:
            _fork_then_abort_parent(engine)
            self.assert_idle_memory_whole(engine)

    def test_reverted_fails(self, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PLUGSERVE_REVERT_FIX", "fork_without_lock")
        with self.engine(model=str(tiny_model_dir)) as engine, pytest.raises(
            KVCorruptionError, match="unlocked prefix: live requests' protected prefixes cover"
        ):
            # Once the parent's lock is gone, the samples read pages nobody locks.
            _fork_then_abort_parent(engine)
