"""Requirements answered from what a plugin *declared*: the gate of the cache-policy and the
speculative-algorithm suites (the attention suite has its own, `requirements.Requirements`).

A suite test names what it needs with `plugserve.testing.conformance.requires(...)` on the
function or class (or through a parameter's `requirements`); the suite's `DeclaredRequirements`
subclass answers each name with None (declared: the test must pass) or the reason it is not
(the test is skipped with that reason). A name the subclass does not know is "not required",
so a test added later for a new capability never breaks an existing plugin; a plugin opts in
by overriding its suite's requirements fixture with a subclass that defines the name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import pytest

from plugserve.testing.conformance.requirements import declared_requirements


class DeclaredRequirements:
    """Each public method is one requirement (`name` or `name:arg`): None when met, else the
    reason it is not."""

    # Suite tests this plugin is known to fail, by test name ("test_x") or with its case id
    # ("test_x[case]"), with why: run as strict xfail, so a fix shows.
    known_failures: ClassVar[dict[str, str]] = {}
    # Public attributes that are not requirement names.
    not_requirements: ClassVar[frozenset[str]] = frozenset(
        {"check", "unmet", "known_failure", "known_failures", "not_requirements", "target",
         "name", "kind"})
    kind: ClassVar[str] = "plugin"

    def __init__(self, target: Any) -> None:
        self.target = target

    @property
    def name(self) -> str:
        return str(self.target.name)

    def known_failure(self, test_name: str) -> str | None:
        return self.known_failures.get(test_name) or self.known_failures.get(
            test_name.split("[")[0])

    def unmet(self, names: Iterable[str]) -> list[str]:
        """The reason for every requirement in `names` that is not met (empty = run)."""
        reasons = [self.check(name) for name in dict.fromkeys(names)]
        return [r for r in reasons if r is not None]

    def check(self, name: str) -> str | None:
        kind, _, arg = name.partition(":")
        method = getattr(type(self), kind, None) if kind.isidentifier() else None
        if kind.startswith("_") or kind in self.not_requirements or not callable(method):
            return (f"requirement {name!r} is not known to {type(self).__name__}: not "
                    "required (override the suite's requirements fixture to opt in)")
        result = getattr(self, kind)(arg) if arg else getattr(self, kind)()
        return None if result is None else str(result)


def gate(request: pytest.FixtureRequest, test_class: type,
         requirements: DeclaredRequirements) -> None:
    """Skip the running test with the reasons its unmet requirements give; mark a known
    failure as strict xfail."""
    callspec = getattr(request.node, "callspec", None)
    params = list(callspec.params.values()) if callspec is not None else []
    unmet = requirements.unmet(declared_requirements(test_class, request.function, *params))
    if unmet:
        pytest.skip("; ".join(unmet))
    known = requirements.known_failure(request.node.name)
    if known is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"known failure: {known}"))
