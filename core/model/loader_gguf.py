"""Loading a single .gguf file: metadata, weights, tokenizer and chat template.

Matrices stored in a kept quantized type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
stay as their blocks (`plugserve.quant.blocks.QuantBlocks`, a view of the memory-mapped
file); F32/F16/BF16 tensors are read as they are today, and other quantized types are
dequantized with one warning naming them. `quantization="none"` dequantizes everything.
Tensors are renamed to HF names, so the same weight plan fills the model. For the
"llama" architecture llama.cpp's converter reorders the rows of every attention head of
attn_q / attn_k so that rope pairs are adjacent; `undo_rope_permutation` puts them back into
the half-split order our rope (and HF) uses (whole rows move, so blocks move as they are).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.gguf_blocks import (
    GGUFTensorError,
    NamingGGUFReader,
    dequantized,
    is_quantized,
    raw_blocks,
)
from plugserve.model.gguf_tokenizer import tokenizer_from_gguf
from plugserve.model.llama import CausalLM
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.weights import check_tensor_names, load_weights
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations

log = logging.getLogger(__name__)

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
                with self.errors_named():
                    return dequantized(t)
        raise ModelLoadError(f"{self.path}: no tensor {name!r}")

    @contextlib.contextmanager
    def errors_named(self) -> Iterator[None]:
        """A `GGUFTensorError` becomes a `ModelLoadError` naming the file and the tensor."""
        try:
            yield
        except GGUFTensorError as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from exc


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file does not exist")
    try:
        reader = NamingGGUFReader(str(path))
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


def _rope_heads(file: GGUFFile, arch: ModelArchConfig, gguf_name: str) -> int | None:
    """The head count whose rows the converter interleaved (llama q/k), else None."""
    if file.metadata.get("general.architecture") != "llama":
        return None
    kind = gguf_name.split(".")[2:3]
    if kind == ["attn_q"]:
        return arch.num_attention_heads
    if kind == ["attn_k"]:
        return arch.num_key_value_heads
    return None


def hf_tensors(file: GGUFFile, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as (HF name, float32 tensor), q/k rows back in HF order."""
    for t in file.reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        with file.errors_named():
            tensor = dequantized(t)
        heads = _rope_heads(file, arch, t.name)
        yield hf_name(t.name), tensor if heads is None else undo_rope_permutation(tensor, heads)


def hf_weights(
    file: GGUFFile, arch: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    """Every weight as (HF name, tensor): matrices of a kept type as their blocks (a view of
    the file; q/k rows reordered into a copy), the rest as float32. Quantized tensors of other
    types are dequantized, with one warning at the end naming them."""
    dequantized_names: dict[str, list[str]] = {}
    for t in file.reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        with file.errors_named():
            blocks = raw_blocks(t)
            if blocks is None:
                if is_quantized(t):
                    dequantized_names.setdefault(t.tensor_type.name, []).append(t.name)
                tensor: torch.Tensor | QuantBlocks = dequantized(t)
            else:
                tensor = blocks
        heads = _rope_heads(file, arch, t.name)
        if heads is not None and isinstance(tensor, QuantBlocks):
            data = undo_rope_permutation(tensor.data, heads).contiguous()
            tensor = QuantBlocks(tensor.qtype, data, tensor.rows, tensor.cols)
        elif heads is not None:
            tensor = undo_rope_permutation(tensor, heads)
        yield hf_name(t.name), tensor
    warn_dequantized(file.path, dequantized_names)


def warn_dequantized(path: Path, by_type: dict[str, list[str]]) -> None:
    """One warning for every quantized tensor of a type not kept quantized."""
    if by_type:
        listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in by_type.items())
        log.warning("%s: tensors of types not kept quantized were dequantized to float (%s)",
                    path, listed)


def keeps_blocks(quantization: str | None, device: torch.device | str) -> bool:
    """Whether a GGUF's quantized matrices stay as blocks: not with quantization "none", and
    only on the CPU for now (the GPU's dequantize-matmul is not built yet)."""
    return quantization != "none" and torch.device(device).type == "cpu"


def load_gguf_model(
    path: str | Path, *, dtype: torch.dtype, device: torch.device | str,
    quantization: str | None = None, quant_activations: Activations = "int8",
) -> LoadedModel:
    """`quantization`: None keeps the file's types; "none" dequantizes every tensor."""
    file = open_gguf(path)
    arch = read_arch(file)
    source = str(file.path)
    if quantization not in (None, "none"):
        raise ModelLoadError(
            f"{source}: quantization {quantization!r} applies to HF model folders; a GGUF file "
            "keeps the types it stores (or quantization 'none' dequantizes them)")
    check_tensor_names(
        [hf_name(n) for n in file.tensor_names if n != ROPE_FREQS], arch, source
    )
    tokenizer = tokenizer_from_gguf(file.metadata, file.path)
    model = CausalLM(arch, dtype=dtype, device=device)
    weights = (hf_weights(file, arch) if keeps_blocks(quantization, device)
               else hf_tensors(file, arch))
    load_weights(model, weights, source, quant_activations)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, source=file.path)
