"""Loading a single .gguf file: metadata, dequantized weights, tokenizer and chat template.

Tensors are dequantized on the CPU (any type `gguf.quants.dequantize` knows: F32, F16, BF16,
Q8_0, Q4_1, ...) and renamed to HF names, so the same weight plan fills the model. For the
"llama" architecture llama.cpp's converter reorders the rows of every attention head of
attn_q / attn_k so that rope pairs are adjacent; `undo_rope_permutation` puts them back into
the half-split order our rope (and HF) uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.gguf_tokenizer import tokenizer_from_gguf
from plugserve.model.llama import CausalLM
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.weights import check_tensor_names, load_weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str:
    """The HF tensor name for a llama.cpp tensor name (unknown names are kept as they are)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return gguf_name


def undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per head, rows stored as interleaved pairs (x0, x_half, x1, x_half+1, ...) go back to
    [first half | second half]. Works for weights [rows, cols] and biases [rows]."""
    head_dim = weight.shape[0] // num_heads
    paired = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return paired.transpose(1, 2).reshape(weight.shape)


@dataclass
class GGUFFile:
    path: Path
    reader: gguf.GGUFReader
    metadata: dict[str, Any]

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in torch layout ([out, in] for matrices)."""
        for t in self.reader.tensors:
            if t.name == name:
                return _dequantized(t)
        raise ModelLoadError(f"{self.path}: no tensor {name!r}")


def _dequantized(t: Any) -> torch.Tensor:
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read as GGUF: {exc}") from exc
    return GGUFFile(path, reader, metadata)


def read_arch(file: GGUFFile) -> ModelArchConfig:
    names = file.tensor_names
    factors = file.tensor(ROPE_FREQS).tolist() if ROPE_FREQS in names else None
    try:
        return ModelArchConfig.from_gguf_metadata(
            file.metadata, tensor_names=names, rope_freq_factors=factors
        )
    except ModelLoadError as exc:
        raise type(exc)(f"{file.path}: {exc}") from exc


def hf_tensors(file: GGUFFile, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as (HF name, float32 tensor), q/k rows back in HF order."""
    unpermute = file.metadata.get("general.architecture") == "llama"
    for t in file.reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name)
        tensor = _dequantized(t)
        if unpermute and t.name.split(".")[2:3] == ["attn_q"]:
            tensor = undo_rope_permutation(tensor, arch.num_attention_heads)
        elif unpermute and t.name.split(".")[2:3] == ["attn_k"]:
            tensor = undo_rope_permutation(tensor, arch.num_key_value_heads)
        yield name, tensor


def load_gguf_model(
    path: str | Path, *, dtype: torch.dtype, device: torch.device | str
) -> LoadedModel:
    file = open_gguf(path)
    arch = read_arch(file)
    source = str(file.path)
    check_tensor_names(
        [hf_name(n) for n in file.tensor_names if n != ROPE_FREQS], arch, source
    )
    tokenizer = tokenizer_from_gguf(file.metadata, file.path)
    model = CausalLM(arch, dtype=dtype, device=device)
    load_weights(model, hf_tensors(file, arch), source)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, source=file.path)
