"""GGUF tensors of the kept types stay quantized: the layers hold the file's blocks (mapped,
not copied), multiply as their dequantized values with float activations, stay close with
int8 activations, and count as blocks in weight_bytes. Other quantized types are dequantized
with one warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from plugserve.model import load_model
from plugserve.model.layers import Embedding, Linear
from plugserve.model.llama import CausalLM
from plugserve.model.weight_bytes import weight_bytes
from plugserve.quant.quantize import quantize
from plugserve.quant.reference import dequantize_rows

from .conftest import (
    PagedRunner,
    gguf_name,
    random_prompts,
    rope_interleave,
    tiny_hf_model,
    write_tiny_gguf,
)

Models = dict[str, tuple[Path, Any]]
LENGTHS = [9, 4]
# int8 activations against float ones on these tiny random models: the logits move by at
# most this share of their largest magnitude.
INT8_LOGIT_TOLERANCE = 0.08


def _load(path: Path, **options: Any) -> CausalLM:
    return load_model(str(path), dtype=torch.float32, device="cpu", **options).model


def _prefill(model: CausalLM, prompts: list[list[int]]) -> torch.Tensor:
    return PagedRunner(model, len(prompts), page_size=4).prefill(prompts).logits


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def _mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (Linux /proc/self/maps), if any."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop:
            return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_kept_types_hold_the_files_blocks(tiny_models: Models, tmp_path: Path,
                                          quant: str) -> None:
    _, hf = tiny_models["llama"]
    path = tmp_path / f"tiny-{quant}.gguf"
    write_tiny_gguf(hf, path, quant=quant)
    model = _load(path, quant_activations="float")
    holders = [m for m in model.modules() if isinstance(m, Linear | Embedding)]
    assert holders and all(m.quant is not None for m in holders)
    assert {p.qtype.name for m in holders for p in m.quant or ()} == {quant.lower()}
    assert all(m.weight.device.type == "meta" for m in holders)  # no dense copy kept
    # unfused matrices are views of the memory-mapped file, not copies
    o_proj = model.decoder_layers[0].self_attn.o_proj.quant
    assert o_proj is not None and _mapped_file(o_proj[0].data.data_ptr()) == str(path)
    assert weight_bytes(model) == _file_tensor_bytes(path)
    assert weight_bytes(model) < weight_bytes(_load(path, quantization="none"))

    prompts = random_prompts(LENGTHS, seed=6)
    kept = _prefill(model, prompts)
    dense = _prefill(_load(path, quantization="none"), prompts)
    torch.testing.assert_close(kept, dense, rtol=0, atol=1e-4)
    assert torch.equal(kept.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_int8_activations_stay_close_to_float(tiny_models: Models, tmp_path: Path,
                                              quant: str) -> None:
    _, hf = tiny_models["llama"]
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, quant=quant)
    prompts = random_prompts(LENGTHS, seed=7)
    as_float = _prefill(_load(path, quant_activations="float"), prompts)
    as_int8 = _prefill(_load(path, quant_activations="int8"), prompts)
    assert not torch.equal(as_int8, as_float)  # the activations really were rounded
    worst = (as_int8 - as_float).abs().max() / as_float.abs().max()
    assert worst <= INT8_LOGIT_TOLERANCE


def test_tied_embedding_is_looked_up_and_read_as_the_head_quantized(
    tiny_models: Models, tmp_path: Path
) -> None:
    _, hf = tiny_models["qwen3"]
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(hf, path, quant="Q8_0")
    model = _load(path, quant_activations="float")
    assert model.lm_head is None and model.embed_tokens.quant is not None
    prompts = random_prompts(LENGTHS, seed=8)
    kept = PagedRunner(model, 2, page_size=4)
    dense = PagedRunner(_load(path, quantization="none"), 2, page_size=4)
    torch.testing.assert_close(kept.prefill(prompts).logits, dense.prefill(prompts).logits,
                               rtol=0, atol=1e-4)
    step = [3, 5]  # a decode step too
    torch.testing.assert_close(kept.decode(step).logits, dense.decode(step).logits,
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_embedding_rows_are_the_references(qtype: str, dtype: torch.dtype) -> None:
    """A lookup gives the rows `dequantize_rows` gives, bit for bit (Q8_0 by the compiled
    decoder where it is built, the others by the reference)."""
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    blocks = quantize(weight, qtype)
    table = Embedding(96, 256, dtype=dtype, device="cpu")
    table.hold_quantized([blocks], "int8")
    ids = torch.tensor([[5, 0, 95], [5, 17, 42]])
    looked_up = table(ids)
    assert looked_up.shape == (2, 3, 256) and looked_up.dtype == dtype
    assert torch.equal(looked_up, dequantize_rows(blocks, ids, dtype))


def _iq4_nl_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid IQ4_NL blocks (a type plugserve does not keep): fp16 scale, 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
    scales = (rng.random(rows * cols // 32) * 0.01).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 32 * 18)


def test_other_quantized_types_load_dequantized_with_one_warning(
    tiny_models: Models, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, hf = tiny_models["llama"]
    path = tmp_path / "mixed.gguf"
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    raw = {f"blk.{i}.ffn_down.weight": (_iq4_nl_blocks(64, 96, i), iq4) for i in range(2)}
    write_tiny_gguf(hf, path, quant="Q8_0", raw=raw)
    with caplog.at_level(logging.WARNING, logger="plugserve.model.loader_gguf"):
        model = _load(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "IQ4_NL" in warnings[0] and str(path) in warnings[0]
    assert "blk.0.ffn_down.weight" in warnings[0] and "blk.1.ffn_down.weight" in warnings[0]
    down = model.decoder_layers[1].mlp.down_proj
    assert down.quant is None  # dense, with the dequantized values
    expected = gguf.quants.dequantize(raw["blk.1.ffn_down.weight"][0], iq4)
    assert torch.equal(down.weight, torch.from_numpy(expected.reshape(64, 96)))
    assert model.decoder_layers[1].self_attn.o_proj.quant is not None


def _random_k_blocks(rows: int, cols: int, kind: str, seed: int) -> np.ndarray:
    """Random valid Q5_K / Q6_K blocks (gguf cannot write them): small fp16 scales."""
    rng = np.random.default_rng(seed)
    size = {"Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    half = (rng.random((blocks.shape[0], 2)) * 0.002).astype(np.float16).view(np.uint8)
    if kind == "Q5_K":  # d and dmin lead the block
        blocks[:, :4] = half.reshape(-1, 4)
    else:  # d ends it
        blocks[:, -2:] = half[:, :2]
    return blocks.reshape(rows, cols // 256 * size)


def test_k_quants_and_a_fused_projection_of_mixed_types(tmp_path: Path) -> None:
    """Q4_K matrices (quantized by plugserve.quant), Q6_K v and Q5_K down projections: the
    fused q/k/v holds its Q4_K and Q6_K rows apart, and the model is the dequantized one."""
    hf = tiny_hf_model("llama", tmp_path / "hf", seed=3, hidden_size=256,
                       intermediate_size=256)
    q4_k, q5_k, q6_k = (getattr(gguf.GGMLQuantizationType, t) for t in ("Q4_K", "Q5_K", "Q6_K"))
    raw: dict[str, tuple[Any, Any]] = {}
    for name, tensor in hf.state_dict().items():
        if tensor.ndim == 2 and "norm" not in name:
            data = tensor.detach().float()
            if ".q_proj." in name:
                data = rope_interleave(data, hf.config.num_attention_heads)
            if ".k_proj." in name:
                data = rope_interleave(data, hf.config.num_key_value_heads)
            raw[gguf_name(name)] = (quantize(data, "q4_k").data.numpy(), q4_k)
    for i in range(2):
        raw[f"blk.{i}.attn_v.weight"] = (_random_k_blocks(128, 256, "Q6_K", i), q6_k)
        raw[f"blk.{i}.ffn_down.weight"] = (_random_k_blocks(256, 256, "Q5_K", 10 + i), q5_k)
    path = tmp_path / "k.gguf"
    write_tiny_gguf(hf, path, raw=raw)
    model = _load(path, quant_activations="float")
    qkv = model.decoder_layers[0].self_attn.qkv_proj.quant
    assert qkv is not None and [(p.qtype.name, p.rows) for p in qkv] == [("q4_k", 384),
                                                                           ("q6_k", 128)]
    down = model.decoder_layers[1].mlp.down_proj.quant
    assert down is not None and down[0].qtype.name == "q5_k"
    assert weight_bytes(model) == _file_tensor_bytes(path)
    prompts = random_prompts(LENGTHS, seed=9)
    kept = _prefill(model, prompts)
    dense = _prefill(_load(path, quantization="none"), prompts)
    torch.testing.assert_close(kept, dense, rtol=0, atol=1e-4)
