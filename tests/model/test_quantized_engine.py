"""Quantized weights through the whole engine (the invariant checker at level 1):

- a Q8_0 / Q4_0 GGUF kept quantized, with float activations, gives transformers' greedy
  tokens for the same file (transformers dequantizes it on load);
- `quantization` q8_0 / q4_0 / q4_k on an HF folder gives the greedy tokens of the same
  model with the quantized-then-dequantized weights run dense, and `weight_bytes` counts
  every matrix as its blocks;
- matrices whose columns are not whole blocks stay dense, listed in one log line;
- a Q8_0 / Q4_1 GGUF's decode steps through the compiled decode stack give the greedy tokens
  of the per-layer path, with int8 and float activations, decode batches past the few-row
  kernel included;
- `kv_cache_dtype="auto"` stores bfloat16 KV for a GGUF's quantized weights with int8
  activations in float32, and the compute dtype otherwise (float activations, dequantized
  weights, an HF folder quantized on load, a backend without a bfloat16 cache).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugserve.kernels import decode_batch, decode_layer
from plugserve.model.quant_on_load import is_layer_matrix
from plugserve.quant.quantize import quantize
from plugserve.quant.reference import dequantize
from plugserve.quant.types import quant_type
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts

from .conftest import tiny_hf_model, write_tiny_gguf

PROMPTS = random_prompts(4, 256, 3, 30, seed=21)
MAX_NEW = [12, 6, 16, 9]
# q4_k needs 256-column blocks: every matrix of this model splits into them
WIDE = {"hidden_size": 256, "intermediate_size": 256}


def _sampling() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]


def _dequantized_folder(folder: Path, out: Path, quantization: str) -> Path:
    """A copy of the HF folder whose layer matrices went through `quantization` and back."""
    shutil.copytree(folder, out)
    tensors = load_file(str(folder / "model.safetensors"))
    qtype = quant_type(quantization)
    for name, tensor in tensors.items():
        if is_layer_matrix(name, tensor) and tensor.shape[1] % qtype.block_elems == 0:
            tensors[name] = dequantize(quantize(tensor, quantization)).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _quantized_bytes(folder: Path, quantization: str) -> tuple[int, int]:
    """(bytes with the layer matrices as blocks, bytes all float32) of the folder's weights."""
    config = json.loads((folder / "config.json").read_text())
    qtype = quant_type(quantization)
    quantized = dense = 0
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        dense += tensor.numel() * 4
        if is_layer_matrix(name, tensor) and tensor.shape[1] % qtype.block_elems == 0:
            quantized += tensor.shape[0] * qtype.row_bytes(tensor.shape[1])
        else:
            quantized += tensor.numel() * 4
    return quantized, dense


class TestQuantizedEngine(EngineTest):
    def _greedy(self, **config: Any) -> tuple[list[list[int]], int]:
        with self.engine(**config) as engine:
            got = [r.token_ids for r in engine.generate(PROMPTS, _sampling())]
            self.assert_idle_memory_whole(engine)
            return got, engine.stats()["weight_bytes"]

    @pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
    def test_gguf_float_activations_match_transformers(self, tmp_path: Path,
                                                       quant: str) -> None:
        hf = tiny_hf_model("llama", tmp_path / "hf", seed=4)
        write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant=quant)
        expected = hf_greedy(tmp_path, PROMPTS, MAX_NEW, gguf_file="tiny.gguf")
        got, _ = self._greedy(model=str(tmp_path / "tiny.gguf"), quant_activations="float")
        assert got == expected

    @pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
    @pytest.mark.parametrize("activations", ["int8", "float"])
    def test_gguf_decode_stack_matches_the_per_layer_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str, activations: str
    ) -> None:
        if not decode_layer.available():
            pytest.skip(f"decode_layer kernel unavailable: {decode_layer.why_unavailable()}")
        hf = tiny_hf_model("llama", tmp_path / "hf", seed=7)
        write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant=quant)
        runs = 0
        real_run = decode_layer.DecodeStack.run

        def counting(stack: decode_layer.DecodeStack, *args: Any) -> Any:
            nonlocal runs
            runs += 1
            return real_run(stack, *args)

        monkeypatch.setattr(decode_layer.DecodeStack, "run", counting)
        config = {"model": str(tmp_path / "tiny.gguf"), "quant_activations": activations}
        compiled, _ = self._greedy(**config)
        compiled_runs = runs
        assert compiled_runs >= max(MAX_NEW) - 1  # every decode step: the stack in one call
        monkeypatch.setattr(decode_layer, "applies", lambda *args: False)
        per_layer, _ = self._greedy(**config)
        assert runs == compiled_runs and compiled == per_layer

    @pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
    @pytest.mark.parametrize("activations", ["int8", "float"])
    def test_gguf_decode_batches_through_the_stack_match_the_per_layer_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str, activations: str
    ) -> None:
        """Twelve requests: the decode batches past the few-row kernel run in the stack (one
        call a step, the many-row quantized path inside), with the per-layer path's greedy
        tokens; with float activations those are transformers' for the same file."""
        if not decode_layer.available():
            pytest.skip(f"decode_layer kernel unavailable: {decode_layer.why_unavailable()}")
        hf = tiny_hf_model("llama", tmp_path / "hf", seed=11)
        write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant=quant)
        prompts = random_prompts(12, 256, 3, 30, seed=23)
        max_new = [6 + i % 5 for i in range(12)]
        batch_rows = 0
        real_run = decode_layer.DecodeStack.run

        def counting(stack: decode_layer.DecodeStack, hidden: torch.Tensor, *args: Any) -> Any:
            nonlocal batch_rows
            if hidden.shape[0] > 8:
                batch_rows += hidden.shape[0]
            return real_run(stack, hidden, *args)

        def greedy() -> list[list[int]]:
            config = {"model": str(tmp_path / "tiny.gguf"), "quant_activations": activations}
            with self.engine(**config) as engine:
                sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new]
                got = [r.token_ids for r in engine.generate(prompts, sampling)]
                self.assert_idle_memory_whole(engine)
            return got

        monkeypatch.setattr(decode_layer.DecodeStack, "run", counting)
        stacked = greedy()
        stacked_rows = batch_rows
        assert stacked_rows >= 12 * (min(max_new) - 1)  # 12 rows a step until one finishes
        monkeypatch.setattr(decode_batch, "_ENABLED", False)
        assert greedy() == stacked
        assert batch_rows == stacked_rows  # the per-layer path: no batch through the stack
        if activations == "float":
            assert stacked == hf_greedy(tmp_path, prompts, max_new, gguf_file="tiny.gguf")

    @pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_k"])
    def test_quantization_on_load_matches_the_dequantized_model(
        self, tmp_path: Path, quantization: str
    ) -> None:
        folder = tmp_path / "hf"
        tiny_hf_model("llama", folder, seed=5, **WIDE)
        reference = _dequantized_folder(folder, tmp_path / "dequantized", quantization)
        expected, dense_bytes = self._greedy(model=str(reference))
        got, held = self._greedy(model=str(folder), quantization=quantization,
                                 quant_activations="float")
        assert got == expected
        quantized_bytes, float_bytes = _quantized_bytes(folder, quantization)
        assert dense_bytes == float_bytes
        assert held == quantized_bytes
        bits = quant_type(quantization).bits_per_weight()  # 8.5, 4.5 or 4.5
        assert held / dense_bytes < bits / 32 + 0.02  # norms stay float32

    def test_int8_activations_run_through_the_engine(self, tmp_path: Path) -> None:
        folder = tmp_path / "hf"
        tiny_hf_model("llama", folder, seed=5, **WIDE)
        got, _ = self._greedy(model=str(folder), quantization="q8_0")
        assert [len(t) for t in got] == MAX_NEW

    def test_columns_not_whole_blocks_stay_dense_in_one_line(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        folder = tmp_path / "hf"
        tiny_hf_model("llama", folder, seed=6)  # 64 and 96 columns: no 256-weight block
        with caplog.at_level(logging.INFO, logger="plugserve.model.quant_on_load"):
            quantized, held = self._greedy(model=str(folder), quantization="q4_k")
        lines = [r.getMessage() for r in caplog.records if "kept dense" in r.getMessage()]
        assert len(lines) == 1 and "q4_k" in lines[0] and "down_proj.weight (96)" in lines[0]
        dense, dense_bytes = self._greedy(model=str(folder))
        assert quantized == dense and held == dense_bytes


    @pytest.mark.parametrize(("config", "expected"), [
        ({}, torch.float32),  # the compute dtype (a bf16 cache moved llama.cpp's tokens)
        ({"quant_activations": "float"}, torch.float32),
        ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16),
        ({"kv_cache_dtype": "float8_e4m3"}, torch.float8_e4m3fn),
        ({"kv_cache_dtype": "float32"}, torch.float32),
        ({"dtype": "bfloat16"}, torch.bfloat16),
    ])
    def test_kv_cache_dtype_of_a_quantized_gguf(
        self, tmp_path: Path, config: dict[str, str], expected: torch.dtype
    ) -> None:
        hf = tiny_hf_model("llama", tmp_path / "hf", seed=8)
        write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant="Q4_1")
        with self.engine(model=str(tmp_path / "tiny.gguf"), **config) as engine:
            assert engine.kv_pool.dtype == expected
            got = [r.token_ids for r in engine.generate(PROMPTS, _sampling())]
            assert [len(t) for t in got] == MAX_NEW
            self.assert_idle_memory_whole(engine)

    def test_auto_kv_cache_dtype_of_an_hf_folder_quantized_on_load(self, tmp_path: Path) -> None:
        folder = tmp_path / "hf"
        tiny_hf_model("llama", folder, seed=5, **WIDE)
        with self.engine(model=str(folder), quantization="q8_0") as engine:
            assert engine.kv_pool.dtype == torch.float32


class TestQuantizedEngineOverlap(TestQuantizedEngine):
    """The same checks under the overlap loop (the next step scheduled while one runs)."""

    env = {"PLUGSERVE_OVERLAP": "1"}
