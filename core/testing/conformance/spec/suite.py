"""The whole speculative-algorithm suite, for
`from plugserve.testing.conformance.spec.suite import *`.

Importing these classes into a test module makes pytest collect them there; the algorithm
they test is the `spec_algorithm` fixture (`--spec-algorithm NAME`, default eagle), the
backends `--spec-backend NAME` (repeatable; default every registered backend).
"""

from __future__ import annotations

from plugserve.testing.conformance.spec.engine import TestSpecFootprint, TestSpecLossless

__all__ = ["TestSpecFootprint", "TestSpecLossless"]
