"""Attention-backend conformance suite: what a backend author runs on their own backend.

SQLAlchemy-dialect style. Pull the suite into a test module with one import and name the
backend with the fixture (or run `pytest --attention-backend NAME` / `plugserve conformance
--attention NAME`):

    from plugserve.testing.conformance.suite import *  # noqa: F403

    @pytest.fixture
    def attention_backend() -> str:
        return "mine"

Kernel level (`suite.kernel`): random paged caches with shuffled page tables, every scenario
of `scenarios.SCENARIOS` on a pairwise sample of page size x GQA x head dim x dtype, checked
against a float64 oracle (`reference`). Engine level (`suite.engine`): whole generations on
tiny models, token-identical to transformers fp32, the checker at level 1, and a probe that
the selected backend ran. Tests a backend's registered `BackendCapabilities` do not cover are
skipped with the reason (`requirements`); `smoke` is a small subset for slow backends.
See docs/backends.md.
"""

from __future__ import annotations

from plugserve.testing.conformance.requirements import Requirements, requires

__all__ = ["Requirements", "requires"]
