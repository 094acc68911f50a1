"""Compiling grammars off the scheduler's thread, once per distinct spec.

`GrammarService.compile(spec)` returns a future at once; the compile runs on one worker
thread of its own, so a request whose grammar is compiling waits in the queue while the others
run (the scheduler admits a request only when its future is done). Compiled grammars are kept
by the spec's text (`GrammarSpec.key`), the most recently used `cache_size` of them; a failed
compile is cached too, so the same bad schema is refused at once the next time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from plugserve.grammar.base import GrammarBackend, GrammarCapabilities, GrammarContext, GrammarError
from plugserve.structured import GrammarSpec


class GrammarService:
    def __init__(self, name: str, load: Callable[[], type[GrammarBackend]],
                 capabilities: GrammarCapabilities, context: GrammarContext,
                 cache_size: int = 256) -> None:
        self.name = name
        self.capabilities = capabilities
        self._load = load
        self._context = context
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str, tuple[str, ...]], Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, "plugserve-grammar")
        self.compiles = 0  # compiles started (cache misses)

    @property
    def backend(self) -> GrammarBackend:
        """The backend (built on first use: building one reads the whole vocabulary)."""
        with self._lock:
            if self._backend is None:
                self._backend = self._load()(self._context)
            return self._backend

    def unsupported(self, spec: GrammarSpec) -> str | None:
        """Why this backend cannot take `spec`'s kind (None: it can)."""
        if spec.kind in self.capabilities.kinds:
            return None
        return (f"grammar backend {self.name!r} does not support {spec.kind} (it supports: "
                f"{', '.join(sorted(self.capabilities.kinds))})")

    def compile(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar of `spec`, now or later; a failure is a `GrammarError`."""
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
                return found
            future: Future[Any] = self._worker.submit(self._compile, spec)
            self._cache[spec.key] = future
            self.compiles += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec) -> Any:
        problem = self.unsupported(spec)
        if problem is not None:
            raise GrammarError(problem)
        try:
            return self.backend.compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # a backend's own exception type: still the request's fault
            raise GrammarError(f"invalid {spec.kind}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
