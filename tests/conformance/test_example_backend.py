"""The docs' worked example backend passes the suite: the whole kernel suite (plain PyTorch is
fast), one fp32 engine run, the half-precision and the speculative engine runs. It is
registered in-process through its plugin module, as `pip install docs/examples/
attention_example` would register it."""

from __future__ import annotations

import pytest

from plugserve.testing.conformance.smoke import TestEngineSmoke  # noqa: F401
from plugserve.testing.conformance.suite.engine import (  # noqa: F401
    TestEngineHalfPrecision,
)
from plugserve.testing.conformance.suite.engine import (
    TestEngineSpeculative as _TestEngineSpeculative,
)
from plugserve.testing.conformance.suite.kernel import *  # noqa: F403


@pytest.mark.integration  # runs the eagle plugin
class TestEngineSpeculative(_TestEngineSpeculative):
    pass


@pytest.fixture
def attention_backend(example_plugins: None) -> str:
    return "example"


def test_registered_through_the_hook(example_plugins: None) -> None:
    from plugserve_attention_example.backend import ExampleBackend
    from plugserve_attention_example.plugin import CAPABILITIES

    from plugserve.plugins import get_plugin_host

    entry = get_plugin_host().registries.attention.get("example")
    assert entry.plugin == "example"
    assert entry.capabilities is CAPABILITIES
    assert entry.load() is ExampleBackend
