"""The base of every suite class: pick the backend under test, gate each test on what it
requires, mark the backend's known failures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plugserve.testing.conformance.requirements import Requirements, declared_requirements
from plugserve.testing.conformance.target import BackendUnderTest


class ConformanceTest:
    """Suite tests get `self.target` (the `BackendUnderTest`). A test needing a capability
    says so with `@requires(...)` on the function or class, or through its parameters'
    `requirements`; when the backend does not declare it the test is skipped with the
    reason. The `conformance_target` and `conformance_requirements` fixtures come from
    plugserve's pytest plugin (`--attention-backend`, `--conformance-device`); a test module
    or conftest may override them."""

    target: BackendUnderTest

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _one_cpu_thread(cls) -> Iterator[None]:
        """The suite's models and kernels are tiny: intra-op threads cost more than they
        save, and on a shared machine they can slow a run down many times over."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)

    @pytest.fixture(autouse=True)
    def _conformance_gate(
        self,
        request: pytest.FixtureRequest,
        conformance_target: BackendUnderTest,
        conformance_requirements: Requirements,
    ) -> None:
        reason = conformance_target.skip_reason()
        if reason is not None:
            pytest.skip(reason)
        callspec = getattr(request.node, "callspec", None)
        params = list(callspec.params.values()) if callspec is not None else []
        names = declared_requirements(type(self), request.function, *params)
        unmet = conformance_requirements.unmet(names)
        if unmet:
            pytest.skip("; ".join(unmet))
        known = conformance_requirements.known_failure(request.node.name)
        if known is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=f"known failure: {known}"))
        self.target = conformance_target
