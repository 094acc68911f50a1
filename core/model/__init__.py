"""Model loading: HF folders, GGUF files and the built-in default model.

`load_model(None | folder | file.gguf, dtype=..., device=...)` returns a `LoadedModel`
(the `CausalLM`, its `ModelArchConfig`, its `Tokenizer` and where it came from).
"""

from __future__ import annotations

from pathlib import Path

import torch

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError
from plugserve.model.llama import CausalLM, CausalLMOutput
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.tokenizer import Tokenizer
from plugserve.model.tp_shard import ModelShard

__all__ = [
    "CausalLM",
    "CausalLMOutput",
    "LoadedModel",
    "ModelArchConfig",
    "ModelLoadError",
    "ModelShard",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "load_model",
]


def load_model(
    path: str | Path | None, *, dtype: torch.dtype, device: torch.device | str,
    shard: ModelShard | None = None,
) -> LoadedModel:
    """None = the built-in SmolLM2-135M-Instruct; a `.gguf` file; or an HF model folder.
    With `shard`, only that tensor-parallel rank's part of every weight is read."""
    from plugserve.model.default_model import default_model_path
    from plugserve.model.loader_gguf import load_gguf_model
    from plugserve.model.loader_hf import load_hf_model

    if shard is not None:
        from plugserve.model.tp_loader import load_shard

        return load_shard(path, shard, dtype=dtype, device=device)
    if path is None:
        return load_hf_model(default_model_path(), dtype=dtype, device=device)
    resolved = Path(path).expanduser()
    if resolved.suffix.lower() == ".gguf":
        return load_gguf_model(resolved, dtype=dtype, device=device)
    return load_hf_model(resolved, dtype=dtype, device=device)
