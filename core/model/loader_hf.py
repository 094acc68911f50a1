"""Loading an HF model folder: config.json, safetensors weights (one file or sharded with an
index), and the tokenizer files. Pickled checkpoints are refused."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.llama import CausalLM
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.quant_on_load import quantized_stream, quantizes_on_load
from plugserve.model.tokenizer import Tokenizer
from plugserve.model.weights import check_tensor_names, load_weights
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing; an HF model folder needs a config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _eos_from_generation_config(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    value = _read_config(path).get("eos_token_id")
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def read_arch(folder: Path) -> ModelArchConfig:
    """The architecture from config.json, with generation_config.json's EOS ids added."""
    config_path = folder / "config.json"
    config = _read_config(config_path)
    try:
        arch = ModelArchConfig.from_hf_config(config)
    except ModelLoadError as exc:
        raise type(exc)(f"{config_path}: {exc}") from exc
    extra_eos = [i for i in _eos_from_generation_config(folder) if i not in arch.eos_token_ids]
    if extra_eos:
        arch = dataclasses.replace(arch, eos_token_ids=(*arch.eos_token_ids, *extra_eos))
    return arch


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_config(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: has no 'weight_map' object")
        indexed = {name: folder / file for name, file in weight_map.items()}
        for shard in sorted(set(indexed.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{shard}: missing; {index_path} lists it as a shard")
        return indexed
    single = folder / SINGLE_FILE
    shards = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt*")
        )
        hint = (
            f" (found only pickled weights {pickled}; they are not loaded for safety: convert "
            "them to safetensors)" if pickled else ""
        )
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    files: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), shard))
        except Exception as exc:
            raise ModelLoadError(f"{shard}: cannot read safetensors: {exc}") from exc
    return files


def _tensors(files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ModelLoadError(f"{path}: lacks tensor {name!r} that the index names")
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc


def load_hf_model(
    path: str | Path, *, dtype: torch.dtype, device: torch.device | str,
    quantization: str | None = None, quant_activations: Activations = "int8",
) -> LoadedModel:
    """`quantization` q8_0 / q4_0 / q4_k quantizes the layers' matrices as they load."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"{folder}: model folder does not exist")
    if not folder.is_dir():
        raise ModelLoadError(
            f"{folder}: not a folder (expected an HF model folder or a .gguf file)"
        )
    arch = read_arch(folder)
    files = weight_files(folder)
    check_tensor_names(files, arch, str(folder))
    model = CausalLM(arch, dtype=dtype, device=device)
    tensors: Iterable[tuple[str, torch.Tensor | QuantBlocks]] = _tensors(files)
    if quantizes_on_load(quantization):
        assert quantization is not None
        tensors = quantized_stream(_tensors(files), quantization, str(folder))
    load_weights(model, tensors, str(folder), quant_activations)
    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=arch.eos_token_ids)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, source=folder)
