"""A backend whose kernels come from a CUDA library, or from a CPU interpreter in tests.

FA3 and FlashInfer are built the same way: `cls(ctx, kernels=None, revert_fixes=None)` refuses
a context it cannot run, takes `kernels` when given (an interpreter module with the same
calls) or else loads the CUDA library, refusing a non-CUDA device first, and reads its fix
toggles; then `allocate(ctx)` sizes the backend's own buffers.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from plugserve.attention.base import AttentionBackend, AttentionContext, resolve_reverts

__all__ = ["KernelLibraryBackend", "kernels_or_cuda_library"]


def kernels_or_cuda_library(ctx: AttentionContext, kernels: Any | None, *, backend: str,
                            library: str, load: Callable[[], Any]) -> Any:
    """The kernels a backend runs: `kernels` when given (a CPU interpreter in tests), else the
    CUDA library `load()` returns; a non-CUDA device is refused first, naming the backend and
    whose kernels it runs (`library`, e.g. "FA3's")."""
    if kernels is not None:
        return kernels
    if torch.device(ctx.device).type != "cuda":
        raise RuntimeError(
            f"attention backend {backend!r} runs {library} CUDA kernels; device "
            f"{str(ctx.device)!r} is not CUDA (use --attention torch_native)"
        )
    return load()


class KernelLibraryBackend(AttentionBackend):
    """Subclasses name whose kernels they run (`kernel_library`, e.g. "FA3's"), how to load
    them (`load_kernels`) and allocate their buffers in `allocate`."""

    kernel_library: ClassVar[str]

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        kernels: Any | None = None,
        revert_fixes: Iterable[str] | None = None,
    ) -> None:
        super().__init__(ctx)
        self.refuse_invalid(ctx)
        self.kernels = kernels_or_cuda_library(
            ctx, kernels, backend=self.name, library=self.kernel_library, load=self.load_kernels)
        self.revert_fixes = resolve_reverts(ctx, revert_fixes)
        self.allocate(ctx)

    @staticmethod
    @abstractmethod
    def load_kernels() -> Any:
        """The CUDA library's namespace (raises ImportError naming what to install)."""

    @abstractmethod
    def allocate(self, ctx: AttentionContext) -> None:
        """Allocate the backend's buffers (`self.kernels` and `self.revert_fixes` are set)."""
