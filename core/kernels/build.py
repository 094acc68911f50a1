"""The CPU kernels as one library: built on first use, loaded once per process.

The C++ in `csrc/` is compiled into one shared library (`plugserve.kernels.compile`): the ops
and the dispatch once, every kernel source once per instruction set copy it holds
(`plugserve.kernels.isa.to_build`): the copy this start runs (the best this CPU has, or the
one `PLUGSERVE_CPU_ISA` names), or with `PLUGSERVE_CPU_ISAS=all` every copy this CPU runs
(the tests switch between them). It is cached under `$TORCH_EXTENSIONS_DIR/plugserve_cpu/<key>`
(default `~/.cache/torch_extensions`), the key a digest of the sources, flags, compiler and
torch, so later starts load it in a fraction of a second.

The engine builds it at start-up (`prepare`), before any request, with a visible status;
anything else that asks (`library()`) builds it then. A machine without a C++ compiler, a
failed build, or `PLUGSERVE_CPU_KERNELS=0` falls back to the pure-torch paths with one
warning (the reason is in `unavailable_reason()`). Decided once per process, never on a hot
path.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from plugserve.kernels import isa as isa_mod
from plugserve.kernels.status import BuildStatus

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ENV_SWITCH = "PLUGSERVE_CPU_KERNELS"
OPS_NAMESPACE = "plugserve_cpu"
KEEP_BUILDS = 3  # library versions kept in the cache (older ones are removed on a build)

_lock = threading.Lock()
_decided = False
_library: Library | None = None
_reason: str | None = None


def enabled_by_environment() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


class Library:
    """The loaded kernels: their ops (`torch.ops.plugserve_cpu`) and the ISA copy in use."""

    def __init__(self, path: Path, built: tuple[str, ...]) -> None:
        import torch

        self.path = path
        self.built = built
        self.ops: Any = getattr(torch.ops, OPS_NAMESPACE)
        self.decode_stack_class: Any = getattr(torch.classes, OPS_NAMESPACE).DecodeStack
        self.current = str(self.ops.isa())
        self.generation = 0  # moves whenever the ISA changes (callers cache per ISA)

    def isa(self) -> str:
        return self.current

    def isas(self) -> list[str]:
        """The copies this library holds that this CPU runs, lowest first."""
        return [str(name) for name in self.ops.isas()]

    def set_isa(self, name: str) -> None:
        """Run the copy called `name` from now on (refused, with the list, if not here)."""
        isa_mod.check_runnable(name)
        if name not in self.built:
            raise ValueError(
                f"the CPU kernels of this process hold only the {', '.join(self.built)} copy; "
                f"to switch to {name}, start with {isa_mod.ENV_ISAS}=all (every copy this CPU "
                f"runs is built) or {isa_mod.ENV_ISA}={name}")
        self.ops.set_isa(name)
        self.current = name
        self.generation += 1

    @property
    def bf16_dot(self) -> bool:
        """Whether the copy in use multiplies bf16 pairs natively (AVX512-BF16)."""
        return isa_mod.has_bf16_dot(self.current)


def cache_root() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions"
    )
    return Path(base) / "plugserve_cpu"


def library() -> Library | None:
    """The kernels, built and loaded on the first call; None where they cannot be had here
    (see `unavailable_reason()`). Cheap after the first call."""
    if _decided:
        return _library
    return prepare()


def unavailable_reason() -> str | None:
    return _reason


def ops() -> Any:
    """`torch.ops.plugserve_cpu` once the kernels are loaded; a RuntimeError with the reason
    where they cannot be had (callers check `library()` first on their fast paths)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the plugserve CPU kernels are unavailable: {_reason}")
    return lib.ops


def prepare(status: BuildStatus | None = None) -> Library | None:
    """Build (if needed) and load the kernels now, showing `status` (default: a rich status
    on a terminal, plain lines elsewhere) while anything compiles."""
    global _decided, _library, _reason
    with _lock:
        if _decided:
            return _library
        try:
            _library, _reason = _load(status)
        finally:
            _decided = True
        if _library is None and _reason is not None and enabled_by_environment():
            log.warning("plugserve: CPU kernels unavailable (%s); using the torch paths", _reason)
        return _library


def _load(status: BuildStatus | None) -> tuple[Library | None, str | None]:
    from plugserve.kernels import compile as compile_mod
    from plugserve.kernels import status as status_mod

    if not enabled_by_environment():
        return None, f"{ENV_SWITCH}=0"
    if shutil.which(compile_mod.compiler()) is None:
        return None, "no C++ compiler (c++ or $CXX) on PATH"
    requested = isa_mod.requested()
    if requested is not None:
        try:
            isa_mod.check_runnable(requested)
        except ValueError as exc:
            return None, f"{isa_mod.ENV_ISA}={requested}: {exc}"
    try:
        isas = isa_mod.to_build()
    except ValueError as exc:
        return None, str(exc)
    spec = compile_mod.LibrarySpec(CSRC, isas, cache_root())
    key, _ = compile_mod.library_key(spec)
    if status is None and not compile_mod.library_path(spec, key).exists():
        status = status_mod.for_stderr(_why_build(spec.cache_root))
    try:
        path = compile_mod.build_library(spec, status or status_mod.Silent())
    except compile_mod.BuildError as exc:
        return None, f"build failed: {exc}"
    except OSError as exc:
        return None, f"build failed: {type(exc).__name__}: {exc}"
    finally:
        if status is not None:
            status.close()
    _prune(spec.cache_root, keep=path.parent)
    try:
        import torch

        torch.ops.load_library(str(path))
        library = Library(path, tuple(i.name for i in isas))
        if requested is not None:
            library.set_isa(requested)
    except (OSError, RuntimeError) as exc:
        return None, f"loading {path} failed: {exc}"
    return library, None


def _builds(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
            and p.name != "objects"]


def _why_build(root: Path) -> str:
    if _builds(root):
        return ("no cached build matches: another set of ISA copies, or changed kernel "
                "sources, flags, compiler or torch")
    return "first start with this cache"


def _prune(root: Path, keep: Path) -> None:
    """Keep the newest KEEP_BUILDS library versions (a loaded one stays usable: its file is
    mapped)."""
    builds = sorted(_builds(root), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [b for b in builds if b != keep][KEEP_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
