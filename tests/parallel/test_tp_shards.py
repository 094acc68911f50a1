"""Sharding without processes: which shapes split, what each rank holds, and that the ranks'
slices (read from safetensors or GGUF, each rank its own) put back together are the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import ModelShard, load_model
from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.loader_hf import read_arch
from plugserve.model.tp_layers import TPCausalLM
from plugserve.model.tp_loader import load_shard, shard_plan
from plugserve.model.tp_shard import tp_problems
from plugserve.model.weights import weight_plan
from tests.model.conftest import TINY_KINDS, tiny_hf_model, write_tiny_gguf

SMOLLM2 = ModelArchConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=1e5, layer_sliding_window=(None,) * 30,
)


def test_shapes_that_do_not_split_are_refused_with_what_would() -> None:
    heads, kv_heads = tp_problems(SMOLLM2, 2)
    assert heads == ("num_attention_heads (9) is not divisible by tp_size 2; tp sizes this "
                     "model can use: 1, 3")
    assert kv_heads.startswith("num_key_value_heads (3) is not divisible by tp_size 2")
    assert tp_problems(SMOLLM2, 3) == []
    assert any("larger than the model's 9 attention heads" in p for p in tp_problems(SMOLLM2, 12))
    eight = dataclasses.replace(SMOLLM2, num_attention_heads=8, num_key_value_heads=4)
    assert tp_problems(eight, 8) == []  # KV heads replicated: each held by two ranks
    assert any("intermediate_size (1536) is not divisible by tp_size 5" in p
               for p in tp_problems(dataclasses.replace(eight, num_attention_heads=10,
                                                        num_key_value_heads=5), 5))


def test_kv_heads_split_or_replicated() -> None:
    arch = dataclasses.replace(SMOLLM2, num_attention_heads=8, num_key_value_heads=2)
    split = [ModelShard(r, 2, arch) for r in range(2)]
    assert [(s.first_head, s.heads, s.first_kv_head, s.kv_heads) for s in split] == [
        (0, 4, 0, 1), (4, 4, 1, 1)]
    replicated = [ModelShard(r, 4, arch) for r in range(4)]
    # query head h reads KV head h // 4: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1
    assert [(s.first_head, s.first_kv_head, s.kv_heads) for s in replicated] == [
        (0, 0, 1), (2, 0, 1), (4, 1, 1), (6, 1, 1)]
    vocab = [ModelShard(r, 4, dataclasses.replace(arch, vocab_size=102)) for r in range(4)]
    assert [s.vocab_range for s in vocab] == [(0, 26), (26, 52), (52, 78), (78, 102)]
    assert {s.vocab_rows for s in vocab} == {26}  # the last rank's 2 padding rows


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_every_tensor_has_a_slice_for_each_rank(kind: str, tmp_path: Path) -> None:
    tiny_hf_model(kind, tmp_path)
    arch = read_arch(tmp_path)
    for rank in range(2):
        assert set(shard_plan(arch, ModelShard(rank, 2, arch))) == set(weight_plan(arch))


def _reassembled(shards: list[TPCausalLM], name: str, dim: int) -> torch.Tensor:
    return torch.cat([dict(s.named_parameters())[name] for s in shards], dim=dim)


def assert_shards_make_the_model(path: Path, tp: int, **options: Any) -> None:
    whole = load_model(str(path), dtype=torch.float32, device="cpu", **options).model
    arch = whole.arch
    shards = [load_shard(str(path), ModelShard(r, tp, arch), dtype=torch.float32,
                         device="cpu", **options).model for r in range(tp)]
    assert all(isinstance(s, TPCausalLM) for s in shards)
    params = dict(whole.named_parameters())
    hd, q, kv = arch.head_dim, arch.q_size, arch.kv_size
    for i in range(arch.num_hidden_layers):
        at = f"layers.{i}"
        qkv = params[f"{at}.self_attn.qkv_proj.weight"]
        parts = [dict(s.named_parameters())[f"{at}.self_attn.qkv_proj.weight"] for s in shards]
        q_local = q // tp
        kv_local = max(1, arch.num_key_value_heads // tp) * hd
        assert torch.equal(torch.cat([p[:q_local] for p in parts]), qkv[:q])
        for r, p in enumerate(parts):
            kv_head = (r * arch.num_attention_heads // tp) // (
                arch.num_attention_heads // arch.num_key_value_heads)
            if arch.num_key_value_heads >= tp:
                kv_head = r * arch.num_key_value_heads // tp
            k_rows = slice(q + kv_head * hd, q + kv_head * hd + kv_local)
            v_rows = slice(q + kv + kv_head * hd, q + kv + kv_head * hd + kv_local)
            assert torch.equal(p[q_local : q_local + kv_local], qkv[k_rows])
            assert torch.equal(p[q_local + kv_local :], qkv[v_rows])
        assert torch.equal(_reassembled(shards, f"{at}.self_attn.o_proj.weight", 1),
                           params[f"{at}.self_attn.o_proj.weight"])
        gate_up = [dict(s.named_parameters())[f"{at}.mlp.gate_up_proj.weight"] for s in shards]
        width = arch.intermediate_size // tp
        whole_gate_up = params[f"{at}.mlp.gate_up_proj.weight"]
        assert torch.equal(torch.cat([g[:width] for g in gate_up]),
                           whole_gate_up[: arch.intermediate_size])
        assert torch.equal(torch.cat([g[width:] for g in gate_up]),
                           whole_gate_up[arch.intermediate_size :])
        assert torch.equal(_reassembled(shards, f"{at}.mlp.down_proj.weight", 1),
                           params[f"{at}.mlp.down_proj.weight"])
        for s in shards:
            assert torch.equal(dict(s.named_parameters())[f"{at}.input_layernorm.weight"],
                               params[f"{at}.input_layernorm.weight"])
    vocab = _reassembled(shards, "embed_tokens.weight", 0)
    assert torch.equal(vocab[: arch.vocab_size], params["embed_tokens.weight"])
    assert not vocab[arch.vocab_size :].any(), "padding rows must be zero"
    head = torch.cat([s.lm_head_weight for s in shards])[: arch.vocab_size]
    assert torch.equal(head, whole.lm_head_weight)


@pytest.mark.parametrize("kind", ["llama3_rope_bias", "qwen3", "gemma3"])
def test_safetensors_shards_make_the_model(kind: str, tmp_path: Path) -> None:
    tiny_hf_model(kind, tmp_path)
    assert_shards_make_the_model(tmp_path, 2)


def test_replicated_kv_heads(tmp_path: Path) -> None:
    tiny_hf_model("llama", tmp_path, num_key_value_heads=1)
    assert_shards_make_the_model(tmp_path, 2)
    assert_shards_make_the_model(tmp_path, 4)


def test_gguf_shards_are_dequantized_per_rank(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_tiny_gguf(hf, path)  # F32, q/k rows in llama.cpp's interleaved order
    assert_shards_make_the_model(path, 2)


def test_quantized_gguf_columns_must_split_at_block_boundaries(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_tiny_gguf(hf, path, quant="Q8_0")
    arch = load_model(str(path), dtype=torch.float32, device="cpu").arch
    # o_proj's 64 input columns split into whole 32-value blocks; down_proj's 96 do not
    with pytest.raises(ModelLoadError, match=r"model.gguf: tensor 'blk.0.ffn_down.weight' is stored as Q8_0 "
                       r"in blocks of 32 values, and split over tp size 2 this rank's columns "
                       r"\[0, 48\) of its 96"):
        load_shard(str(path), ModelShard(0, 2, arch), dtype=torch.float32, device="cpu")


def test_quantized_gguf_shards_dequantized_per_rank(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", tmp_path / "hf", intermediate_size=128)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(hf, path, quant="Q8_0")  # every split is 32-value blocks at tp 2
    # quantization "none": dequantized (kept blocks: tests/parallel/test_tp_quantized.py)
    assert_shards_make_the_model(path, 2, quantization="none")
