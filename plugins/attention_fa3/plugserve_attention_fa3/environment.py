"""Whether this machine can load FlashAttention 3, checked without importing it.

FA3 comes from sgl-kernel (`sgl_kernel.flash_attn`, prebuilt) or from flash-attention's
hopper/ build (`flash_attn_interface`, compiled against the installed torch). sgl-kernel's
`flash_ops` extension is built against one torch release and links C++ symbols of torch's
libraries; when the installed torch no longer exports one of them the import fails with an
"undefined symbol" deep in the first forward's import. With the pinned torch 2.13 that is the
case for every sgl-kernel on PyPI checked (0.2.9 to 0.3.21): `flash_ops` needs
`c10::impl::cow::materialize_cow_storage(c10::StorageImpl&)`, which torch 2.13's libc10 no
longer exports (it has `materialize_cow(c10::StorageImpl*)`), and
`torch::Library::_def(...)` with a signature libtorch_cpu 2.13 lacks. `torch_symbol_problem`
finds that out with `nm -D` before anything is imported.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import torch

# The sgl-kernel the checks ran against (reference.py, tests/test_fa3_api.py) and the torch
# its wheel is built for (its README: "Requires torch == 2.9.1").
PINNED_SGL_KERNEL = "0.3.21"
SGL_KERNEL_TORCH = {"0.3.21": "2.9.1"}
INSTALL_HINT = (
    "pip install 'plugserve-attention-fa3[cuda]' (sgl-kernel's FA3), or build FA3 from "
    "flash-attention's hopper/ directory (module flash_attn_interface)"
)
# Mangled-name prefixes of torch's C++ namespaces, and of the CUDA parts a CPU build lacks.
_TORCH_NAMESPACES = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch")
_CUDA_NAMESPACES = ("_ZN3c104cuda", "_ZNK3c104cuda", "_ZN2at4cuda", "_ZNK2at4cuda")


def _dynamic_symbols(library: Path, *, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, str(library)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def demangle(symbols: Iterable[str]) -> list[str]:
    names = list(symbols)
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         timeout=60, check=False).stdout.splitlines()
    return out if len(out) == len(names) else names


def undefined_symbols(extension: Path) -> set[str]:
    """The dynamic symbols `extension` (a shared library) needs from others, mangled."""
    return _dynamic_symbols(extension, defined=False)


def missing_torch_symbols(needed: Iterable[str], torch_lib: Path | None = None) -> list[str]:
    """Of the mangled symbols `needed`, the torch C++ ones the libraries in `torch_lib`
    (default: the installed torch's) do not export, demangled. CUDA-namespace symbols are not
    counted when the libraries are a CPU build (no libc10_cuda.so)."""
    torch_lib = torch_lib or Path(torch.__file__).parent / "lib"
    exported: set[str] = set()
    for library in sorted(torch_lib.glob("lib*.so*")):
        exported |= _dynamic_symbols(library, defined=True)
    skip_cuda = not any(torch_lib.glob("libc10_cuda.so*"))
    torch_needed = [s for s in needed if s.startswith(_TORCH_NAMESPACES)
                    and not (skip_cuda and s.startswith(_CUDA_NAMESPACES))]
    return sorted(demangle(sorted(s for s in torch_needed if s not in exported)))


def sgl_kernel_flash_ops() -> Path | None:
    """The installed sgl-kernel's flash_ops extension, without importing sgl_kernel."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("flash_ops*.so"))
        if found:
            return found[0]
    return None


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def symbol_problem_message(missing: list[str], sgl_version: str | None) -> str:
    """One line: what sgl-kernel's flash_ops needs that this torch lacks, and what works."""
    built_for = SGL_KERNEL_TORCH.get(sgl_version or "")
    works = (f"torch=={built_for} with sgl-kernel=={sgl_version}" if built_for
             else "the torch this sgl-kernel was built for")
    return (f"sgl-kernel {sgl_version or '?'}'s flash_ops cannot load with torch "
            f"{torch.__version__}: it needs {missing[0]}"
            + (f" (and {len(missing) - 1} more torch symbols)" if len(missing) > 1 else "")
            + f", which torch's libraries do not export. FA3 loads with {works}, or with a "
            f"flash-attention hopper/ build compiled against torch {torch.__version__} "
            "(module flash_attn_interface)")


def fa3_problem() -> str | None:
    """Why no FA3 build can load here (None: one can, as far as can be told unimported)."""
    if importlib.util.find_spec("flash_attn_interface") is not None:
        return None
    flash_ops = sgl_kernel_flash_ops()
    if flash_ops is None:
        return f"no FA3 build is installed: {INSTALL_HINT}"
    if shutil.which("nm") is None:
        return None  # cannot tell; the import will say
    missing = missing_torch_symbols(undefined_symbols(flash_ops))
    if missing:
        return symbol_problem_message(missing, installed_version("sgl-kernel"))
    return None


def unavailable_reason() -> str | None:
    """Every reason this machine cannot run the backend, in one line (None: it can)."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append(f"torch {torch.__version__} sees no CUDA device")
    problem = fa3_problem()
    if problem:
        reasons.append(problem)
    return "; ".join(reasons) or None
