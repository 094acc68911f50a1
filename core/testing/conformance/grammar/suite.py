"""The whole grammar-backend suite, for `from plugserve.testing.conformance.grammar.suite
import *`; the backend is the `grammar_backend` fixture (`--grammar-backend NAME`)."""

from __future__ import annotations

from plugserve.testing.conformance.grammar.engine import TestGrammarEngine
from plugserve.testing.conformance.grammar.kernel import TestGrammarKernel

__all__ = ["TestGrammarEngine", "TestGrammarKernel"]
