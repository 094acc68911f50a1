"""Cache-policy conformance suite: what a cache-policy author runs on their own policy.

    from plugserve.testing.conformance.cache.suite import *  # noqa: F403

    @pytest.fixture
    def cache_policy() -> str:
        return "mine"

or `pytest --cache-policy NAME` / `plugserve conformance --cache NAME`. Kernel level
(`kernel`): the policy's data structure on a pool of its own, driven as the KV manager drives
it (`harness`). Engine level (`engine`): whole generations on tiny models, token-identical to
transformers fp32, the checker at level 1. Tests of a capability the policy does not declare
(`prefix_sharing`, `sliding_window`, `sessions`) are skipped with the reason. See
docs/cache_policies.md.
"""
