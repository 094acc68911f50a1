"""What a suite test needs, and whether the backend under test declares it.

SQLAlchemy-dialect style: a test names its requirements (`@requires("custom_mask")`, or a
case's own `requirements`); the `Requirements` object of the backend under test answers each
one from the backend's registered `BackendCapabilities` and the page>1+topk>1 whitelist. An
unmet requirement skips the test with the reason; a met one means the test must pass.

A requirement name this `Requirements` does not know is "not required": the test is skipped,
so a suite test added for a new capability never breaks an existing plugin. A plugin opts
in by overriding the `conformance_requirements` fixture with a subclass that defines the new
name (a method returning None when met, or the reason it is not).

Names: `dtype:NAME`, `page_size:N`, `custom_mask`, `speculative` (= custom_mask: the engine
refuses every speculative algorithm without it), `topk_gt1`, `page_tree` (page>1 with
topk>1: the whitelist decides), `sliding_window`, `tensor_parallel`, `spec_algorithm:NAME`
(installed), `kv_cache_dtype:NAME` (a KV cache of NAME under wider queries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from plugserve.attention.base import BackendCapabilities
    from plugserve.testing.conformance.target import BackendUnderTest

F = TypeVar("F", bound=Callable[..., Any])

REQUIRES_ATTR = "__conformance_requires__"


def requires(*names: str) -> Callable[[F], F]:
    """Decorator: the test (function or class) needs every requirement in `names`."""

    def mark(obj: F) -> F:
        setattr(obj, REQUIRES_ATTR, (*getattr(obj, REQUIRES_ATTR, ()), *names))
        return obj

    return mark


def declared_requirements(*objects: object) -> list[str]:
    """The requirement names attached to `objects` (test function, class, parameters)."""
    names: list[str] = []
    for obj in objects:
        names += list(getattr(obj, REQUIRES_ATTR, ()))
        names += list(getattr(obj, "requirements", ()) or ())
    return names


class Requirements:
    """Answers requirement names for one backend under test (see the module docstring).

    Each public method is one requirement: it returns None when the backend meets it, else
    the reason it does not. `dtype:float16` calls `dtype("float16")`.
    """

    # Suite tests this backend is known to fail, by test name (every case) or with its case
    # id ("test_x[case]"), with why. They run as strict xfail: once fixed they fail until the
    # entry is removed, so a known failure can never hide a new one for long.
    known_failures: ClassVar[dict[str, str]] = {}

    def __init__(self, target: BackendUnderTest) -> None:
        self.target = target

    def known_failure(self, test_name: str) -> str | None:
        """Why `test_name` ("test_x" or "test_x[case]") is expected to fail, or None."""
        return self.known_failures.get(test_name) or self.known_failures.get(
            test_name.split("[")[0])

    @property
    def caps(self) -> BackendCapabilities:
        return self.target.capabilities

    @property
    def name(self) -> str:
        return self.target.name

    def unmet(self, names: Iterable[str]) -> list[str]:
        """The reason for every requirement in `names` that is not met (empty = run)."""
        reasons = []
        for name in dict.fromkeys(names):
            reason = self.check(name)
            if reason is not None:
                reasons.append(reason)
        return reasons

    def check(self, name: str) -> str | None:
        kind, _, arg = name.partition(":")
        method = getattr(type(self), kind, None) if kind.isidentifier() else None
        if kind.startswith("_") or kind in _NOT_REQUIREMENTS or not callable(method):
            return (f"requirement {name!r} is not known to {type(self).__name__}: not "
                    "required (override the conformance_requirements fixture to opt in)")
        result = getattr(self, kind)(arg) if arg else getattr(self, kind)()
        return None if result is None else str(result)

    # --- the requirements ------------------------------------------------------------------
    def dtype(self, dtype: str) -> str | None:
        if dtype in self.caps.dtypes:
            return None
        return (f"attention backend {self.name!r} does not declare dtype {dtype!r} "
                f"(declares {sorted(self.caps.dtypes)})")

    def page_size(self, size: str) -> str | None:
        sizes = self.caps.page_sizes
        if sizes is None or int(size) in sizes:
            return None
        return (f"attention backend {self.name!r} does not declare page_size {size} "
                f"(declares {sorted(sizes)})")

    def custom_mask(self) -> str | None:
        if self.caps.custom_mask:
            return None
        return (f"attention backend {self.name!r} declares custom_mask=False (no tree-mask "
                "verify, so the engine refuses every speculative algorithm with it)")

    def speculative(self) -> str | None:
        """Any speculative decoding (chain or tree): the engine needs a custom-mask verify."""
        return self.custom_mask()

    def topk_gt1(self) -> str | None:
        reason = self.speculative()
        if reason is not None or self.caps.topk_gt1:
            return reason
        return f"attention backend {self.name!r} declares topk_gt1=False (no tree drafting)"

    def page_tree(self) -> str | None:
        """Tree drafting (topk>1) on a paged cache (page_size>1): the whitelist decides, by
        the distribution that registered the backend and its name."""
        from plugserve.attention.whitelist import page_tree_whitelist_text

        reason = self.speculative()
        if reason is not None:
            return reason
        if self.target.entry.page_tree_allowed():
            return None
        return (f"attention backend {self.name!r} ({self.target.entry.origin()}) is not in "
                f"plugserve.registry.PAGE_TREE_WHITELIST ({page_tree_whitelist_text()}): "
                "page_size>1 with topk>1 is refused for it")

    def sliding_window(self) -> str | None:
        if self.caps.sliding_window:
            return None
        return f"attention backend {self.name!r} declares sliding_window=False"

    def kv_cache_dtype(self, name: str) -> str | None:
        if name in self.caps.kv_cache_dtypes:
            return None
        return (f"attention backend {self.name!r} does not declare kv_cache_dtype {name!r} "
                f"(declares {sorted(self.caps.kv_cache_dtypes)})")

    def tensor_parallel(self) -> str | None:
        if self.caps.tensor_parallel:
            return None
        return (f"attention backend {self.name!r} declares tensor_parallel=False (tp_size > 1 "
                "is refused for it)")

    def spec_algorithm(self, name: str) -> str | None:
        from plugserve.plugins import get_plugin_host

        if name in get_plugin_host().registries.spec:
            return None
        return f"speculative algorithm {name!r} is not installed (its plugin is not loaded)"


# Public attributes of Requirements that are not requirement names.
_NOT_REQUIREMENTS = frozenset({"unmet", "check", "caps", "name", "target", "known_failure",
                               "known_failures"})
