"""Proof that the engine ran the backend under test: its class, and counted calls.

`BackendProbe.attach(engine.backend)` wraps the instance's `init_forward_metadata`,
`forward`, `forward_extend`, `forward_decode` and `paged_decode_plan` (instance attributes
shadow the class's methods, so the runner, the model layers and a spec algorithm all go
through the wrappers). A plan the backend hands out is one layer's attention too: the model
runs the paged-decode kernel on the backend's operands instead of calling `forward`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from plugserve.attention.base import AttentionBackend
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode

PROBED = (
    "init_forward_metadata", "forward", "forward_extend", "forward_decode", "paged_decode_plan"
)


class BackendProbe:
    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.calls: Counter[str] = Counter()
        self.mixed_batches = 0  # extend batches carrying decoding requests (mixed chunks)

    @classmethod
    def attach(cls, backend: AttentionBackend) -> BackendProbe:
        probe = cls(backend)
        for name in PROBED:
            setattr(backend, name, probe._counted(name, getattr(backend, name)))
        return probe

    def _counted(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if name == "init_forward_metadata" and args and isinstance(args[0], ForwardBatch):
                self.mixed_batches += is_mixed(args[0])
            result = method(*args, **kwargs)
            if name == "paged_decode_plan" and result is not None:
                self.calls["plans_run"] += 1
            return result

        return counted

    def assert_ran(
        self, expected: type[AttentionBackend], name: str, *, layers_per_batch: int | None = None
    ) -> None:
        """The engine's backend is the class registered as `name`, and it did the work:
        metadata per batch, then `layers_per_batch` attention calls per batch when given
        (`forward`, or a plan handed out)."""
        got = type(self.backend)
        assert got is expected, (
            f"engine.backend is {got.__module__}.{got.__qualname__}, not "
            f"{expected.__module__}.{expected.__qualname__} registered as {name!r}")
        batches = self.calls["init_forward_metadata"]
        forwards = self.calls["forward"]
        layers_run = forwards + self.calls["plans_run"]
        assert batches > 0, f"{name!r}: init_forward_metadata was never called"
        assert layers_run > 0, f"{name!r}: neither forward nor a decode plan was ever used"
        if type(self.backend).forward is AttentionBackend.forward:
            attended = self.calls["forward_extend"] + self.calls["forward_decode"]
            assert attended == forwards, (
                f"{name!r}: {forwards} forward calls but {attended} forward_extend/"
                "forward_decode calls")
        if layers_per_batch is not None:
            assert layers_run == batches * layers_per_batch, (
                f"{name!r}: {forwards} forward calls and {self.calls['plans_run']} decode plans "
                f"for {batches} batches of {layers_per_batch} attention layers")


def is_mixed(fb: ForwardBatch) -> bool:
    """An EXTEND batch with a prompt chunk beside a decoding request (one new token after
    its committed KV)."""
    pairs = list(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True))
    return (fb.mode is ForwardMode.EXTEND and any(n > 1 for _, n in pairs)
            and any(p > 0 and n == 1 for p, n in pairs))
