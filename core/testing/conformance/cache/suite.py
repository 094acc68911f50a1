"""The whole cache-policy suite, for `from plugserve.testing.conformance.cache.suite import *`.

Importing these classes into a test module makes pytest collect them there; the policy they
test is the `cache_policy` fixture (`--cache-policy NAME`, default radix), which the module
may override.
"""

from __future__ import annotations

from plugserve.testing.conformance.cache.engine import (
    TestCacheEngine,
    TestCacheEngineSessions,
    TestCacheEngineSlidingWindow,
)
from plugserve.testing.conformance.cache.kernel import (
    TestCacheKernel,
    TestCacheKernelSlidingWindow,
)

__all__ = [
    "TestCacheEngine",
    "TestCacheEngineSessions",
    "TestCacheEngineSlidingWindow",
    "TestCacheKernel",
    "TestCacheKernelSlidingWindow",
]
