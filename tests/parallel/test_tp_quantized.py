"""Tensor parallelism over quantized weights: each rank holds its slice of the blocks (a
row-parallel matrix cut between blocks, never inside one), the slices put back together are
the one-rank model, a shape whose slice would split a block is refused with the reason, and
two ranks give the greedy tokens of one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import ModelShard, load_model
from plugserve.model.errors import ModelLoadError
from plugserve.model.llama import CausalLM
from plugserve.model.tp_loader import load_shard
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import random_prompts
from tests.model.conftest import tiny_hf_model, write_tiny_gguf

# 128 MLP columns: 64 a rank, two 32-weight blocks
SPLITS = {"intermediate_size": 128}


def _gguf(tmp_path: Path, quant: str = "Q8_0", **overrides: Any) -> Path:
    hf = tiny_hf_model("llama", tmp_path / "hf", seed=9, **overrides)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, quant=quant)
    return path


def _shards(path: str, tp: int, **options: Any) -> tuple[CausalLM, list[CausalLM]]:
    whole = load_model(path, dtype=torch.float32, device="cpu", **options).model
    shards = [load_shard(path, ModelShard(r, tp, whole.arch), dtype=torch.float32,
                         device="cpu", **options).model for r in range(tp)]
    return whole, shards


def _assert_slices_make_the_model(whole: CausalLM, shards: list[CausalLM]) -> None:
    arch, tp = whole.arch, len(shards)
    hd = arch.head_dim
    for i in range(arch.num_hidden_layers):
        one = whole.decoder_layers[i]
        parts = [s.decoder_layers[i] for s in shards]
        assert all(p.self_attn.o_proj.quant is not None for p in parts)
        o_proj = torch.cat([p.self_attn.o_proj.dense_weight() for p in parts], dim=1)
        assert torch.equal(o_proj, one.self_attn.o_proj.dense_weight())
        down = torch.cat([p.mlp.down_proj.dense_weight() for p in parts], dim=1)
        assert torch.equal(down, one.mlp.down_proj.dense_weight())
        qkv = one.self_attn.qkv_proj.dense_weight()
        q, kv = arch.q_size, arch.kv_size
        q_rows = q // tp
        for r, p in enumerate(parts):
            got = p.self_attn.qkv_proj.dense_weight()
            kv_rows = max(1, arch.num_key_value_heads // tp) * hd
            want = torch.cat([qkv[r * q_rows:(r + 1) * q_rows],
                              qkv[q + r * kv_rows:q + (r + 1) * kv_rows],
                              qkv[q + kv + r * kv_rows:q + kv + (r + 1) * kv_rows]])
            assert torch.equal(got, want)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_gguf_blocks_split_between_ranks(tmp_path: Path, quant: str) -> None:
    path = _gguf(tmp_path, quant, **SPLITS)
    whole, shards = _shards(str(path), 2)
    _assert_slices_make_the_model(whole, shards)
    embed = torch.cat([s.embed_tokens.dense_weight() for s in shards])
    assert torch.equal(embed[: whole.arch.vocab_size], whole.embed_tokens.dense_weight())


def test_quantization_on_load_splits_between_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    tiny_hf_model("llama", folder, seed=9, **SPLITS)
    whole, shards = _shards(str(folder), 2, quantization="q8_0")
    _assert_slices_make_the_model(whole, shards)


def test_a_slice_inside_a_block_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = _gguf(tmp_path)  # 96 MLP columns: 48 a rank, not whole 32-weight blocks
    arch = load_model(str(path), dtype=torch.float32, device="cpu").arch
    with pytest.raises(ModelLoadError, match=r"ffn_down.*Q8_0 in blocks of 32.*tp size 2.*"
                                             r"\[0, 48\) of its 96"):
        load_shard(str(path), ModelShard(0, 2, arch), dtype=torch.float32, device="cpu")
    folder = tmp_path / "hf"  # the HF folder of the same model, quantized on load
    with pytest.raises(ModelLoadError, match=r"down_proj.weight' has 96 columns; split over "
                                             r"tp size 2 each rank gets 48.*32-weight q8_0"):
        load_shard(str(folder), ModelShard(0, 2, arch), dtype=torch.float32, device="cpu",
                   quantization="q8_0")


class TestQuantizedTensorParallel(EngineTest):
    @pytest.mark.parametrize("activations", ["float", "int8"])
    def test_tp2_equals_tp1(self, tmp_path: Path, activations: str) -> None:
        path = str(_gguf(tmp_path, **SPLITS))
        prompts = random_prompts(4, 256, 3, 30, seed=31)
        sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 5, 20, 9)]
        with self.engine(model=path, quant_activations=activations) as one:
            tp1 = [r.token_ids for r in one.generate(prompts, sampling)]
            whole_bytes = one.stats()["weight_bytes"]
        with self.engine(model=path, quant_activations=activations, tp_size=2) as two:
            tp2 = [r.token_ids for r in two.generate(prompts, sampling)]
            self.assert_idle_memory_whole(two)
            per_rank = two.stats()["tensor_parallel"]["memory_per_rank"]
        assert tp2 == tp1
        for held in per_rank:  # each rank holds about half the blocks
            assert held["weights_bytes"] <= 0.65 * whole_bytes, (held, whole_bytes)


class TestRefusedAtStartUp(EngineTest):
    def test_engine_with_a_slice_inside_a_block_stops_with_the_reason(
        self, tmp_path: Path
    ) -> None:
        path = str(_gguf(tmp_path))  # 96 MLP columns
        with pytest.raises(ModelLoadError, match=r"ffn_down.*blocks of 32.*tp size 2"):
            self.engine(model=path, tp_size=2)
