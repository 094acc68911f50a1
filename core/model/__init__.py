"""Model loading: HF folders, GGUF files and the built-in default model.

`load_model(None | folder | file.gguf, dtype=..., device=...)` returns a `LoadedModel`
(the `CausalLM`, its `ModelArchConfig`, its `Tokenizer` and where it came from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError
from plugserve.model.llama import CausalLM, CausalLMOutput
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.tokenizer import Tokenizer
from plugserve.model.tp_shard import ModelShard
from plugserve.quant.reference import Activations

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
    shard: ModelShard | None = None, quantization: str | None = None,
    quant_activations: Activations = "int8",
) -> LoadedModel:
    """None = the built-in SmolLM2-135M-Instruct; a `.gguf` file; or an HF model folder.
    With `shard`, only that tensor-parallel rank's part of every weight is read.
    `quantization`: None keeps what the file stores (a GGUF's blocks stay quantized);
    "none" dequantizes a GGUF; q8_0 / q4_0 / q4_k quantizes an HF folder's matrices on load.
    `quant_activations` ("int8" or "float") is how quantized matmuls take their input."""
    opts: dict[str, Any] = {"quantization": quantization, "quant_activations": quant_activations}
    from plugserve.model.default_model import default_model_path
    from plugserve.model.loader_gguf import load_gguf_model
    from plugserve.model.loader_hf import load_hf_model

    if shard is not None:
        from plugserve.model.tp_loader import load_shard

        return load_shard(path, shard, dtype=dtype, device=device, **opts)
    if path is None:
        return load_hf_model(default_model_path(), dtype=dtype, device=device, **opts)
    resolved = Path(path).expanduser()
    if resolved.suffix.lower() == ".gguf":
        return load_gguf_model(resolved, dtype=dtype, device=device, **opts)
    return load_hf_model(resolved, dtype=dtype, device=device, **opts)
