"""sgl-kernel's FA3 extension against this torch, at test time: the torch C++ symbols the
pinned sgl-kernel's `flash_ops` needs (read with `nm -D` from its wheel, downloaded once and
cached; skipped with the reason when it cannot be fetched) are checked against the installed
torch's libraries, and the backend's start-up refusal names what is missing and what works."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plugserve_attention_fa3 import environment
from plugserve_attention_fa3.environment import (
    PINNED_SGL_KERNEL,
    SGL_KERNEL_TORCH,
    missing_torch_symbols,
)


@pytest.fixture(scope="module")
def flash_ops_needs(sgl_kernel_file: Callable[[str], Path]) -> list[str]:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    return sgl_kernel_file("flash_ops.undefined").read_text().split()


def test_pinned_sgl_kernel_against_this_torch(flash_ops_needs: list[str]) -> None:
    missing = missing_torch_symbols(flash_ops_needs)
    built_for = SGL_KERNEL_TORCH[PINNED_SGL_KERNEL]
    if torch.__version__.split("+")[0] == built_for:
        assert missing == [], f"sgl-kernel {PINNED_SGL_KERNEL} on its own torch: {missing}"
        return
    # The pinned torch 2.13 lacks what sgl-kernel's flash_ops (built for 2.9.1) links.
    assert any("materialize_cow_storage" in m for m in missing), missing


def test_start_up_refuses_with_the_missing_symbol(
    flash_ops_needs: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = missing_torch_symbols(flash_ops_needs)
    if not missing:
        pytest.skip(f"sgl-kernel {PINNED_SGL_KERNEL} loads with torch {torch.__version__}")
    fake = tmp_path / "flash_ops.abi3.so"
    fake.touch()
    monkeypatch.setattr(environment.importlib.util, "find_spec",
                        lambda name: None if name == "flash_attn_interface" else object())
    monkeypatch.setattr(environment, "sgl_kernel_flash_ops", lambda: fake)
    monkeypatch.setattr(environment, "undefined_symbols", lambda path: set(flash_ops_needs))
    monkeypatch.setattr(environment, "installed_version", lambda dist: PINNED_SGL_KERNEL)
    problem = environment.fa3_problem()
    assert problem is not None and missing[0] in problem
    assert f"torch=={SGL_KERNEL_TORCH[PINNED_SGL_KERNEL]} with sgl-kernel=={PINNED_SGL_KERNEL}" \
        in problem and "flash_attn_interface" in problem
    reason = environment.unavailable_reason()
    assert reason is not None and "\n" not in reason and missing[0] in reason


def test_nm_reads_this_torch() -> None:
    """The check itself can fail: a symbol libc10 exports is not reported missing, a made-up
    one is."""
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    libc10 = Path(torch.__file__).parent / "lib" / "libc10.so"
    out = subprocess.run(["nm", "-D", "--defined-only", str(libc10)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    real = next(line.split()[-1] for line in out.splitlines() if "_ZN3c10" in line)
    assert missing_torch_symbols([real, "_ZN3c104impl11made_up_symEv"]) == [
        "c10::impl::made_up_sym()"]
