"""Gemma 3 text models: config fields as transformers reads them, weights, logits and refusals.

Logit tolerance: fp32 logits within ATOL = 1e-4 (absolute) of transformers' (the observed
difference is ~3e-5 on logits of magnitude ~5) and the same argmax on every row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import (
    CausalLM,
    ModelArchConfig,
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
)
from plugserve.model.weights import weight_plan
from plugserve.testing.tiny_models import make_tiny_model_dir

from .conftest import PagedRunner, hf_logits, random_prompts, split_rows

ATOL = 1e-4
SMALL: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
}


def _hf_config(**values: Any) -> Any:
    from transformers import Gemma3TextConfig

    values = {k: v for k, v in values.items() if k not in ("architectures", "model_type")}
    return Gemma3TextConfig(**values)


def _hf_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers' Gemma3Attention sets it."""
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM(config)
    return tuple(layer.self_attn.sliding_window for layer in model.model.layers)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # every default: pattern 6, window 4096, rope bases 1e6 / 1e4, head_dim 256
        {"sliding_window_pattern": 3, "sliding_window": 16},
        {"layer_types": ["full_attention", "sliding_attention"] * 4, "sliding_window": 8},
        {"rope_theta": 5e5, "rope_local_base_freq": 100.0,
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}},  # transformers 4.x layout
        {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}},  # 5.x
        {"head_dim": 32, "query_pre_attn_scalar": 24, "num_key_value_heads": 1,
         "tie_word_embeddings": False, "final_logit_softcapping": 30.0},
    ],
    ids=["defaults", "pattern3", "layer_types", "v4_rope", "v5_rope", "sizes"],
)
def test_config_is_read_as_transformers_reads_it(extra: dict[str, Any]) -> None:
    config = {**SMALL, **extra}
    arch = ModelArchConfig.from_hf_config(config)
    hf = _hf_config(**config)
    assert arch.model_type == "gemma3"
    assert arch.layer_sliding_window == _hf_windows(hf)
    assert arch.is_hybrid_sliding_window
    assert arch.head_dim == hf.head_dim and arch.num_key_value_heads == hf.num_key_value_heads
    assert arch.attention_scaling == hf.query_pre_attn_scalar**-0.5
    assert arch.tie_word_embeddings == hf.tie_word_embeddings
    assert arch.final_logit_softcapping == hf.final_logit_softcapping
    assert arch.max_position_embeddings == hf.max_position_embeddings
    assert arch.embedding_scale == hf.hidden_size**0.5
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert arch.rope_theta == full["rope_theta"] and arch.local_rope_theta == local["rope_theta"]
    expected_scaling = (
        None if full["rope_type"] == "default"
        else {"rope_type": full["rope_type"], "factor": full["factor"]}
    )
    assert arch.rope_scaling == expected_scaling and arch.local_rope_scaling is None
    assert [arch.layer_uses_local_rope(i) for i in range(arch.num_hidden_layers)] == [
        t == "sliding_attention" for t in hf.layer_types
    ]
    assert (arch.hidden_act, arch.norm_unit_offset, arch.sandwich_norms, arch.qk_norm) == (
        "gelu_pytorch_tanh", True, True, True
    )


def test_hf_config_round_trip_loads_in_transformers() -> None:
    arch = ModelArchConfig.from_hf_config(
        {**SMALL, "sliding_window": 8, "final_logit_softcapping": 3.0, "head_dim": 32,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )
    written = arch.to_hf_config()
    assert ModelArchConfig.from_hf_config(written) == arch
    hf = _hf_config(**written)
    assert _hf_windows(hf) == arch.layer_sliding_window
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == arch.local_rope_theta
    assert hf.rope_parameters["full_attention"]["factor"] == 8.0


def test_gemma_fields_cannot_be_written_as_a_llama_config() -> None:
    arch = ModelArchConfig.from_hf_config(SMALL)
    llama = ModelArchConfig(
        **{**arch.__dict__, "model_type": "llama",
           "layer_sliding_window": (None,) * arch.num_hidden_layers, "sliding_window": None}
    )
    with pytest.raises(ModelLoadError, match="a llama HF config cannot express hidden_act="):
        llama.to_hf_config()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"attn_logit_softcapping": 50.0},
         r"attn_logit_softcapping=50\.0 is not supported.*only null"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ({"hidden_activation": "gelu"},
         r"hidden_activation 'gelu' is not supported for Gemma 3; only 'gelu_pytorch_tanh'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
         "must be keyed by layer type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"sliding_window_pattern": 0}, r"sliding_window_pattern must be a positive .* got 0"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(ModelLoadError, match=expected):
        ModelArchConfig.from_hf_config({**SMALL, **change})


def test_multimodal_gemma3_is_refused_naming_the_text_model() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        ModelArchConfig.from_hf_config(
            {**SMALL, "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
        )
    assert "Gemma3ForConditionalGeneration" in str(err.value)
    assert "Gemma3ForCausalLM" in str(err.value)


def test_gguf_gemma3_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(2)
    writer.add_sliding_window(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(str(path), dtype=torch.float32, device="cpu")
    message = str(err.value)
    assert str(path) in message and "GGUF architecture 'gemma3' is not supported" in message
    for missing in ("sliding_window_pattern", "freq_base_swa", "query_pre_attn_scalar"):
        assert missing in message


def test_weight_plan_uses_gemma3_tensor_names() -> None:
    arch = ModelArchConfig.from_hf_config({**SMALL, "head_dim": 32})
    plan = weight_plan(arch)
    layer = {name.removeprefix("model.layers.3.") for name in plan if ".layers.3." in name}
    assert layer == {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }
    assert "lm_head.weight" not in plan  # tied
    assert plan["model.layers.3.self_attn.q_norm.weight"].param == "layers.3.self_attn.q_norm.weight"


def test_embedding_scale_is_rounded_to_the_model_dtype() -> None:
    # transformers multiplies by sqrt(hidden) cast to the weights' dtype: sqrt(3072) = 55.43
    # is 55.5 in bfloat16.
    arch = ModelArchConfig.from_hf_config(
        {**SMALL, "hidden_size": 3072, "num_hidden_layers": 1, "max_position_embeddings": 16,
         "head_dim": 8}
    )
    scales = {}
    for dtype in (torch.bfloat16, torch.float32):
        scale = CausalLM(arch, dtype=dtype).embed_scale
        assert scale is not None and scale.dtype == dtype
        scales[dtype] = scale.item()
    assert scales[torch.bfloat16] == 55.5
    assert scales[torch.float32] == pytest.approx(3072**0.5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_across_the_window_match_transformers(tmp_path: Path, page_size: int) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model_dir(tmp_path / "g", arch="gemma3", seed=2,
                                 final_logit_softcapping=2.0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(str(folder), dtype=torch.float32, device="cpu")
    window = loaded.arch.sliding_window
    assert window is not None
    lengths = [3 * window + 5, window - 3, 2 * window]
    prompts = random_prompts(lengths, seed=4)
    runner = PagedRunner(loaded.model, len(prompts), page_size=page_size, max_len=128)
    out = runner.prefill(prompts)
    assert out.logits.abs().max().item() <= 2.0  # soft-capped
    for i, (prompt, ours) in enumerate(zip(prompts, split_rows(out.logits, lengths), strict=True)):
        ref = hf_logits(hf, prompt)
        diff = (ours - ref).abs().max().item()
        assert diff <= ATOL, f"prompt {i}: max abs diff {diff:.3g} > {ATOL}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"prompt {i}: argmax differs"
    sequences = [list(p) for p in prompts]
    last = out.logits[torch.tensor(lengths).cumsum(0) - 1]
    for step in range(window + 2):  # decode the short prompt past its window
        tokens = last.argmax(-1).tolist()
        for seq, token in zip(sequences, tokens, strict=True):
            seq.append(token)
        last = runner.decode(tokens).logits
        if step % 6 == 5 or step == window + 1:
            for i, seq in enumerate(sequences):
                ref = hf_logits(hf, seq)[-1]
                diff = (last[i] - ref).abs().max().item()
                assert diff <= ATOL, f"decode {step} req {i}: max abs diff {diff:.3g}"


def test_bfloat16_gemma3_tracks_float32(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path / "g", arch="gemma3", seed=3)
    prompts = random_prompts([45, 9], seed=6)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(folder), dtype=dtype, device="cpu").model
        logits[dtype] = PagedRunner(model, 2, page_size=16).prefill(prompts).logits
    assert logits[torch.bfloat16].dtype == torch.float32
    scale = logits[torch.float32].abs().max().item()
    diff = (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item()
    assert diff < 0.1 * scale, f"bf16 drifted {diff:.3g} from fp32 (logit scale {scale:.3g})"
