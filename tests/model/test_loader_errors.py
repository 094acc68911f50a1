"""Every way an HF folder can be wrong gives one ModelLoadError that says what and where."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugserve.model import ModelLoadError, UnsupportedArchitectureError, load_model

from .conftest import PagedRunner, random_prompts

Models = dict[str, tuple[Path, Any]]


def _copy(tiny_models: Models, kind: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.copytree(tiny_models[kind][0], target)
    return target


def _load(path: Path | str) -> Any:
    return load_model(str(path), dtype=torch.float32, device="cpu")


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        _load(missing)
    assert str(missing) in str(err.value)


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: GGUF file does not exist"):
        _load(tmp_path / "nope.gguf")


def test_a_file_that_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a folder"):
        _load(path)


def test_missing_config(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        _load(folder)


def test_unsupported_architecture(tiny_models: Models, tmp_path: Path) -> None:
    from transformers import GPT2Config

    folder = _copy(tiny_models, "llama", tmp_path)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4).to_dict()
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        _load(folder)
    message = str(err.value)
    assert str(folder / "config.json") in message
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


def test_missing_tensor(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        _load(folder)
    message = str(err.value)
    assert str(folder) in message
    assert "missing tensor(s) model.layers.1.self_attn.k_proj.weight" in message


def test_misshaped_tensor(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        _load(folder)
    assert "'model.layers.0.mlp.up_proj.weight' has shape (95, 64)" in str(err.value)
    assert "needs (96, 64)" in str(err.value)


def test_unexpected_tensor(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.q_norm"
    ):
        _load(folder)


def test_no_weights_and_pickles_are_refused(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"
    ):
        _load(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickled weights"):
        _load(folder)


def _shard(folder: Path) -> dict[str, str]:
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_sharded_checkpoint_loads_the_same_model(tiny_models: Models, tmp_path: Path) -> None:
    single = tiny_models["qwen2_swa"][0]
    folder = _copy(tiny_models, "qwen2_swa", tmp_path)
    _shard(folder)
    prompts = random_prompts([6, 3], seed=8)
    results = [
        PagedRunner(_load(path).model, 2, page_size=1).prefill(prompts).logits
        for path in (single, folder)
    ]
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_sharded_checkpoint_with_a_missing_shard(tiny_models: Models, tmp_path: Path) -> None:
    folder = _copy(tiny_models, "llama", tmp_path)
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: missing"):
        _load(folder)
