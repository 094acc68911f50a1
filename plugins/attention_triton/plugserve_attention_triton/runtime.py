"""Choose how the Triton kernels run, before they are imported.

Triton decides at decoration time whether a kernel is compiled for a GPU or run by its CPU
interpreter: it reads `TRITON_INTERPRET` when `@triton.jit` runs, i.e. when our kernel modules
are first imported. So the choice must be made before that import, once per process:

- device "cpu": the kernels need the interpreter. If `TRITON_INTERPRET` is unset we set it to
  "1" ourselves (automatic, logged). If the user set it to a false value, or the kernels were
  already imported compiled in this process, we refuse with a message saying what to do.
- device "cuda": CUDA must be available. If the interpreter is on, the kernels still run
  (slowly, through host copies) and a warning says so.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
_KERNEL_PACKAGE = "plugserve_attention_triton.kernels"

log = logging.getLogger(__name__)


class TritonRuntimeError(RuntimeError):
    """The Triton backend cannot run on the requested device in this process."""


def _env_is_true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "on", "yes")


def interpreter_requested() -> bool:
    """Whether `TRITON_INTERPRET` is set to a true value right now."""
    return _env_is_true(os.environ.get(INTERPRET_ENV, ""))


def kernels_imported() -> bool:
    return _KERNEL_PACKAGE in sys.modules


def kernels_interpreted() -> bool:
    """Whether the already-imported kernels were decorated for the interpreter."""
    kernels = sys.modules.get(_KERNEL_PACKAGE)
    return bool(getattr(kernels, "INTERPRETED", False))


def _import_triton() -> None:
    try:
        importlib.import_module("triton")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TritonRuntimeError(
            "attention backend 'triton' needs the 'triton' package: pip install triton "
            f"(import failed: {exc})"
        ) from exc


def triton_imported_without_interpreter() -> bool:
    """`triton` is imported and its own @jit helpers (tl.max, tl.sum, ...) were decorated for
    compilation: setting the interpreter variable now comes too late for them."""
    if "triton" not in sys.modules:
        return False
    standard = sys.modules.get("triton.language.standard")
    helper = getattr(standard, "max", None)
    return helper is not None and type(helper).__name__ != "InterpretedFunction"


def _prepare_cpu() -> None:
    if not kernels_imported() and triton_imported_without_interpreter():
        raise TritonRuntimeError(
            "attention backend 'triton' on device 'cpu' needs the Triton interpreter, but "
            "'triton' was already imported in this process without it (torch.compile or an "
            "optimizer import it), so its library functions are compiled-only. Start the "
            f"process with {INTERPRET_ENV}=1 in the environment to run Triton on the CPU."
        )
    if kernels_imported():
        if not kernels_interpreted():
            raise TritonRuntimeError(
                "attention backend 'triton' on device 'cpu' needs the Triton interpreter, but "
                "its kernels were already compiled for CUDA in this process. Start the process "
                f"with {INTERPRET_ENV}=1 in the environment to run them on the CPU."
            )
        return
    raw = os.environ.get(INTERPRET_ENV)
    if raw is None or raw.strip() == "":
        os.environ[INTERPRET_ENV] = "1"
        log.info("attention backend 'triton' on cpu: set %s=1 (Triton CPU interpreter)",
                 INTERPRET_ENV)
    elif not _env_is_true(raw):
        raise TritonRuntimeError(
            f"attention backend 'triton' on device 'cpu' runs only through the Triton "
            f"interpreter, but {INTERPRET_ENV}={raw!r} turns it off. Set {INTERPRET_ENV}=1 "
            "(before plugserve imports the kernels), or use a CUDA device, or pick another "
            "attention backend (e.g. --attention torch_native)."
        )


def _prepare_cuda() -> None:
    if not torch.cuda.is_available():
        raise TritonRuntimeError(
            "attention backend 'triton' was asked to run on 'cuda' but torch sees no CUDA "
            "device. Use --device cpu (the kernels then run in the Triton interpreter, "
            f"{INTERPRET_ENV}=1), or pick another attention backend."
        )
    if (kernels_imported() and kernels_interpreted()) or (
        not kernels_imported() and interpreter_requested()
    ):
        log.warning(
            "attention backend 'triton' runs on cuda through the Triton interpreter (%s is "
            "set): results are correct but slow; unset it for compiled kernels",
            INTERPRET_ENV,
        )


def prepare_triton_runtime(device: torch.device | str) -> ModuleType:
    """Make the kernels runnable on `device` and return the imported kernel package."""
    kind = torch.device(device).type
    if kind == "cpu":
        _prepare_cpu()
    elif kind == "cuda":
        _prepare_cuda()
    else:
        raise TritonRuntimeError(
            f"attention backend 'triton' supports devices 'cpu' (interpreter) and 'cuda', "
            f"not {kind!r}"
        )
    _import_triton()
    return importlib.import_module(_KERNEL_PACKAGE)
