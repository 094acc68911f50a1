"""pytest plugin registered by plugserve: fixtures every plugin's test suite can use.

The attention-backend conformance suite (`plugserve.testing.conformance`) reads its backend
and device from here: `--attention-backend NAME` (default torch_native) and
`--conformance-device DEVICE` (default: cpu if the backend declares it, else cuda), or from
a test module's own `attention_backend` / `conformance_device` fixtures, which win. The same
for the cache-policy suite (`--cache-policy NAME`, default radix; fixture `cache_policy`) and
the speculative-algorithm suite (`--spec-algorithm NAME`, default eagle, fixture
`spec_algorithm`; `--spec-backend NAME`, repeatable, the attention backends it runs on), and
the grammar-backend suite (`--grammar-backend NAME`, default xgrammar, fixture
`grammar_backend`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plugserve", "plugserve conformance suites")
    group.addoption("--attention-backend", metavar="NAME", default=None,
                    help="registered attention backend the conformance suite tests "
                    "(default: torch_native)")
    group.addoption("--conformance-device", metavar="DEVICE", default=None,
                    help="device the conformance suite runs on (default: cpu if the "
                    "backend declares it, else cuda); a missing device skips the suite")
    group.addoption("--cache-policy", metavar="NAME", default=None,
                    help="registered cache policy the cache-policy conformance suite tests "
                    "(default: radix)")
    group.addoption("--spec-algorithm", metavar="NAME", default=None,
                    help="registered speculative algorithm the speculative conformance suite "
                    "tests (default: eagle)")
    group.addoption("--spec-backend", metavar="NAME", action="append", default=None,
                    help="attention backend the speculative conformance suite runs on "
                    "(repeatable; default: every registered backend)")
    group.addoption("--grammar-backend", metavar="NAME", default=None,
                    help="registered grammar backend the grammar conformance suite tests "
                    "(default: xgrammar)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model folder (weights, config, tokenizer), built once a session."""
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


@pytest.fixture
def attention_backend(request: pytest.FixtureRequest) -> str:
    """Name of the attention backend the conformance suite tests."""
    return str(request.config.getoption("--attention-backend") or "torch_native")


@pytest.fixture
def conformance_device(request: pytest.FixtureRequest) -> str | None:
    """Device of the conformance suite (None: cpu if the backend declares it, else cuda)."""
    device = request.config.getoption("--conformance-device")
    return str(device) if device else None


@pytest.fixture
def conformance_target(attention_backend: str, conformance_device: str | None) -> Any:
    """The `BackendUnderTest`: registry entry, class, capabilities and device."""
    from plugserve.testing.conformance.target import BackendUnderTest

    return BackendUnderTest.resolve(attention_backend, conformance_device)


@pytest.fixture
def conformance_requirements(conformance_target: Any) -> Any:
    """The `Requirements` answering what the backend declares; override with a subclass to
    opt into requirements this plugserve does not know, or to list known failures."""
    from plugserve.testing.conformance.requirements import Requirements

    return Requirements(conformance_target)


@pytest.fixture
def cache_policy(request: pytest.FixtureRequest) -> str:
    """Name of the cache policy the cache-policy conformance suite tests."""
    return str(request.config.getoption("--cache-policy") or "radix")


@pytest.fixture
def cache_target(cache_policy: str) -> Any:
    """The `CachePolicyUnderTest`: registry entry, class and capabilities."""
    from plugserve.testing.conformance.cache.target import CachePolicyUnderTest

    return CachePolicyUnderTest.resolve(cache_policy)


@pytest.fixture
def cache_requirements(cache_target: Any) -> Any:
    """The `CacheRequirements` answering what the policy declares; override with a subclass
    to opt into requirements this plugserve does not know, or to list known failures."""
    from plugserve.testing.conformance.cache.target import CacheRequirements

    return CacheRequirements(cache_target)


@pytest.fixture
def spec_algorithm(request: pytest.FixtureRequest) -> str:
    """Name of the speculative algorithm the speculative conformance suite tests."""
    return str(request.config.getoption("--spec-algorithm") or "eagle")


@pytest.fixture
def spec_target(spec_algorithm: str) -> Any:
    """The `SpecAlgorithmUnderTest`: registry entry, class and capabilities."""
    from plugserve.testing.conformance.spec.target import SpecAlgorithmUnderTest

    return SpecAlgorithmUnderTest.resolve(spec_algorithm)


@pytest.fixture
def spec_requirements(spec_target: Any) -> Any:
    """The `SpecRequirements` answering what the algorithm declares (override as above)."""
    from plugserve.testing.conformance.spec.target import SpecRequirements

    return SpecRequirements(spec_target)


@pytest.fixture
def grammar_backend(request: pytest.FixtureRequest) -> str:
    """Name of the grammar backend the grammar conformance suite tests."""
    return str(request.config.getoption("--grammar-backend") or "xgrammar")


@pytest.fixture
def grammar_target(grammar_backend: str) -> Any:
    """The `GrammarBackendUnderTest`: registry entry, class and capabilities."""
    from plugserve.testing.conformance.grammar.target import GrammarBackendUnderTest

    return GrammarBackendUnderTest.resolve(grammar_backend)
