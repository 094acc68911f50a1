"""Speculative-algorithm conformance suite: what a spec-algorithm author runs on their own
algorithm.

    from plugserve.testing.conformance.spec.suite import *  # noqa: F403

    @pytest.fixture
    def spec_algorithm() -> str:
        return "mine"

or `pytest --spec-algorithm NAME [--spec-backend B ...]` / `plugserve conformance --spec
NAME`. For every attention backend x page size x topk x normal/overlap combination the
capability table allows (`cases`), on a tiny target: the footprint's promises, lossless
greedy output, the checker at level 1, and a probe that every round stays inside its
footprint (`probe`). An algorithm that needs a draft model builds one for the tiny target
with `SpecAlgorithm.build_test_draft` (`models`). See docs/spec_algorithms.md.
"""
