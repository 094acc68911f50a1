"""The cache-policy suite FAILS each broken policy of broken_caches.py, at kernel and engine
level, and only where its bug is: this is what proves the suite can fail. Each case runs the
suite's own test method on the broken policy (test_cli_conformance.py shows the same through
the command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.testing import EngineTest
from plugserve.testing.conformance.cache import engine, kernel
from plugserve.testing.conformance.cache.target import CachePolicyUnderTest

# The suite's classes, by module: imported by name they would be collected here too.
K, KS = kernel.TestCacheKernel, kernel.TestCacheKernelSlidingWindow
E, ES = engine.TestCacheEngine, engine.TestCacheEngineSessions
EW = engine.TestCacheEngineSlidingWindow
RANDOM = "test_random_operations_keep_the_law"
# policy -> (suite tests that must fail on it, suite tests its bug does not touch); a test
# is (class, method, arguments).
Case = tuple[type, str, dict[str, Any]]
EXPECTED: dict[str, tuple[list[Case], list[Case]]] = {
    "cache_forgets_duplicates": (
        [(K, "test_duplicates_are_reported", {"page_size": 4}), (K, RANDOM, {"page_size": 1}),
         (E, "test_greedy_and_prefix_reuse", {"page_size": 16}),
         (E, "test_n_samples_fork_the_prompt", {"page_size": 16})],
        [(K, "test_matches_are_whole_pages_of_stored_slots", {"page_size": 4}),
         (K, "test_locked_entries_survive_eviction", {"page_size": 4})],
    ),
    "cache_evicts_locked": (
        [(K, "test_locked_entries_survive_eviction", {"page_size": 1}),
         (K, RANDOM, {"page_size": 4}),
         (E, "test_retract_and_evict_on_a_small_pool", {"page_size": 16})],
        [(K, "test_duplicates_are_reported", {"page_size": 4}),
         (E, "test_greedy_and_prefix_reuse", {"page_size": 16}),
         (E, "test_n_samples_fork_the_prompt", {"page_size": 4})],
    ),
    "cache_unaligned_match": (
        [(K, "test_matches_are_whole_pages_of_stored_slots", {"page_size": 4}),
         (E, "test_greedy_and_prefix_reuse", {"page_size": 16})],
        [(K, "test_matches_are_whole_pages_of_stored_slots", {"page_size": 1}),
         (K, RANDOM, {"page_size": 1}), (E, "test_greedy_and_prefix_reuse", {"page_size": 1})],
    ),
    "cache_path_size_zero": (
        [(K, "test_nested_locks_count", {"page_size": 1}), (K, RANDOM, {"page_size": 4}),
         (ES, "test_sessions", {"page_size": 1})],
        [(K, "test_duplicates_are_reported", {"page_size": 1}),
         (E, "test_greedy_and_prefix_reuse", {"page_size": 1})],
    ),
    "cache_no_swa_sizes": (
        [(KS, "test_random_operations_keep_both_laws", {"page_size": 4}),
         (EW, "test_sliding_window_model", {"page_size": 4})],
        [(K, RANDOM, {"page_size": 4}), (E, "test_greedy_and_prefix_reuse", {"page_size": 16})],
    ),
}
BROKEN = pytest.mark.parametrize("name", sorted(EXPECTED))


def run_suite_test(case: Case, target: CachePolicyUnderTest, fixtures: dict[str, Any]) -> None:
    """Run one suite test method on `target`, as the suite would (the gate is not needed:
    every case here is one the broken policy declares)."""
    cls, method, args = case
    suite = cls()
    suite.target = target
    kwargs = dict(args)
    if cls in (K, KS) and method.startswith("test_random"):
        kwargs["seed"] = 0
    if cls in (E, ES):
        kwargs.setdefault("tiny_model_dir", fixtures["tiny_model_dir"])
        if method != "test_chunked_prefill_and_mixed_chunk":
            kwargs.setdefault("overlap", False)
    if cls is EW:
        kwargs.update(tmp_path_factory=fixtures["tmp_path_factory"], overlap=False)
    getattr(suite, method)(**kwargs)


class TestBrokenPoliciesFail(EngineTest):
    @BROKEN
    def test_the_suite_fails_where_the_bug_is(
        self, name: str, cache_plugins: None, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        target = CachePolicyUnderTest.resolve(name)
        fixtures = {"tiny_model_dir": tiny_model_dir, "tmp_path_factory": tmp_path_factory}
        must_fail, must_pass = EXPECTED[name]
        for case in must_fail:
            with pytest.raises(Exception) as failure:  # an assertion or the checker's error
                run_suite_test(case, target, fixtures)
            assert failure.type.__name__ in ("AssertionError", "KVLeakError",
                                             "KVCorruptionError"), failure.value
        for case in must_pass:
            run_suite_test(case, target, fixtures)
