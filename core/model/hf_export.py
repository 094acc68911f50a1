"""Writing a model as an HF folder (config.json, model.safetensors, tokenizer files), so that
it loads through `load_hf_model` and through transformers alike."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plugserve.model.arch import ModelArchConfig
from plugserve.model.gguf_tokenizer import tokenizer_from_gguf
from plugserve.model.loader_gguf import hf_tensors, open_gguf, read_arch
from plugserve.model.tokenizer import Tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_folder(
    folder: Path,
    arch: ModelArchConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Tokenizer,
) -> None:
    """Write into an existing, empty `folder`; tensors are stored as float32."""
    _write_json(folder / "config.json", arch.to_hf_config())
    generation: dict[str, Any] = {"bos_token_id": arch.bos_token_id}
    eos = sorted(tokenizer.eos_token_ids | set(arch.eos_token_ids))
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    _write_json(folder / "generation_config.json", generation)
    state = {name: t.to(torch.float32).contiguous() for name, t in tensors}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_hf_files(folder)


def export_gguf_as_hf_folder(gguf_path: Path, folder: Path) -> None:
    """Dequantize a GGUF model to float32 and write it as an HF folder."""
    file = open_gguf(gguf_path)
    arch = read_arch(file)
    tokenizer = tokenizer_from_gguf(file.metadata, file.path)
    write_hf_folder(folder, arch, hf_tensors(file, arch), tokenizer)
