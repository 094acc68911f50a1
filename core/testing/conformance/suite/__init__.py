"""The whole conformance suite, for `from plugserve.testing.conformance.suite import *`.

Importing these classes into a test module makes pytest collect them there (SQLAlchemy's
dialect-suite pattern); the backend they test is the `attention_backend` fixture
(`--attention-backend NAME`, default torch_native), which the module may override.
"""

from __future__ import annotations

from plugserve.testing.conformance.suite.engine import (
    TestEngineGreedy,
    TestEngineHalfPrecision,
    TestEngineSpeculative,
)
from plugserve.testing.conformance.suite.kernel import (
    TestKernelDecode,
    TestKernelExtend,
    TestKernelKVCacheDtype,
    TestKernelSlidingWindow,
    TestKernelSpeculative,
)
from plugserve.testing.conformance.suite.tensor_parallel import TestEngineTensorParallel

__all__ = [
    "TestEngineGreedy",
    "TestEngineHalfPrecision",
    "TestEngineSpeculative",
    "TestEngineTensorParallel",
    "TestKernelDecode",
    "TestKernelExtend",
    "TestKernelKVCacheDtype",
    "TestKernelSlidingWindow",
    "TestKernelSpeculative",
]
