"""Helpers for the model tests: tiny random HF models, and running our model by hand.

`tiny_hf_model(kind, folder)` builds a small transformers model with every parameter
randomised (norm weights and biases too, so a swapped or dropped tensor changes the
logits), saves it with safetensors plus a byte-level tokenizer, and returns the HF model as
the reference. `PagedRunner` drives our `CausalLM` the way the engine does: a KV pool whose
page 0 is padding, a req_to_token table with each request's pages interleaved with the
others', and ForwardBatches for a prefill and for decode steps through the torch_native
backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from plugserve.attention.base import AttentionContext
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.model.llama import CausalLM, CausalLMOutput
from plugserve.model.tokenizer import Tokenizer
from plugserve.pools.kv_pool import KVPool
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode

SPECIAL_TOKENS = ("<s>", "</s>", "<|user|>", "<|assistant|>")
TINY_VOCAB = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }}{{ m['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_BASE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # head_dim 16 then has wavelengths in all 3 bands
}
# kind -> (transformers config class name, overrides)
TINY_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope_bias": (
        "LlamaConfig",
        {
            "rope_scaling": LLAMA3_ROPE,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2_swa": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "mistral_swa": ("MistralConfig", {"sliding_window": 4}),
    # 5 local : 1 global layers, head_dim != hidden / heads, attention scale from
    # query_pre_attn_scalar, a local rope base, linear scaling on the global layer and
    # final logit soft-capping low enough to bend these logits.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 32,
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
}


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens (no merges) followed by SPECIAL_TOKENS, with a small chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return Tokenizer(
        backend,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a distinct random value: norms around 1, the rest around 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.2 * noise)


def tiny_hf_model(kind: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """Save a tiny random `kind` model (see TINY_KINDS) to `folder`; return the HF model."""
    import transformers

    config_name, kind_overrides = TINY_KINDS[kind]
    config_cls = getattr(transformers, config_name)
    config = config_cls(**{**_BASE, **kind_overrides, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    byte_level_tokenizer().save_hf_files(folder)
    return model


def hf_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float()


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


class PagedRunner:
    """Runs prefill and decode forwards of `model` for a fixed set of requests."""

    def __init__(
        self, model: CausalLM, num_reqs: int, *, page_size: int, max_len: int = 64
    ) -> None:
        arch = model.arch
        self.model = model
        self.page_size = page_size
        pages_per_req = math.ceil(max_len / page_size)
        self.pool = KVPool(
            num_pages=num_reqs * pages_per_req,
            page_size=page_size,
            layer_ids=list(range(arch.num_hidden_layers)),
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        # Request i owns pages i+1, i+1+num_reqs, ... (page 0 is the padding page).
        pos = torch.arange(pages_per_req * page_size)
        pages = 1 + torch.arange(num_reqs)[:, None] + (pos // page_size)[None, :] * num_reqs
        self.req_to_token = (pages * page_size + pos % page_size).to(torch.int64)
        self.backend = TorchNativeBackend(
            AttentionContext(
                num_heads=arch.num_attention_heads,
                num_kv_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim,
                page_size=page_size,
                max_batch_size=num_reqs,
                context_len=max_len,
                dtype=model.dtype,
                device=model.device,
            )
        )
        self.seq_lens = [0] * num_reqs

    def _run(
        self,
        mode: ForwardMode,
        new_tokens: list[list[int]],
        *,
        last_only: bool,
        capture_hidden: bool,
    ) -> CausalLMOutput:
        prefix = list(self.seq_lens)
        ext = [len(t) for t in new_tokens]
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        rows = torch.arange(len(new_tokens))
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)])
        out_cache_loc = torch.cat(
            [self.req_to_token[i, p:s] for i, (p, s) in enumerate(zip(prefix, seq, strict=True))]
        )
        ends = torch.tensor(ext).cumsum(0) - 1
        fb = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq),
            extend_prefix_lens=torch.tensor(prefix),
            extend_seq_lens=torch.tensor(ext),
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            logits_indices=ends if last_only else None,
            capture_hidden=capture_hidden,
        )
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            out = self.model(fb, self.backend)
        self.seq_lens = seq
        return out

    def prefill(
        self, prompts: list[list[int]], *, last_only: bool = False, capture_hidden: bool = False
    ) -> CausalLMOutput:
        return self._run(
            ForwardMode.EXTEND, prompts, last_only=last_only, capture_hidden=capture_hidden
        )

    def decode(self, tokens: list[int]) -> CausalLMOutput:
        return self._run(
            ForwardMode.DECODE, [[t] for t in tokens], last_only=False, capture_hidden=False
        )


def split_rows(logits: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return list(logits.split(list(lengths)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every TINY_KINDS model, saved once a session: kind -> (folder, HF model)."""
    built = {}
    for kind in TINY_KINDS:
        folder = tmp_path_factory.mktemp(kind)
        built[kind] = (folder, tiny_hf_model(kind, folder))
    return built


def rope_interleave(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes attn_q / attn_k in (pairs side by side)."""
    head_dim = weight.shape[0] // num_heads
    halves = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def write_tiny_gguf(
    hf_model: Any, path: Path, *, quant: str = "F32", rope_freqs: torch.Tensor | None = None,
    raw: dict[str, tuple[Any, Any]] | None = None,
) -> None:
    """Write `hf_model` (a tiny model from `tiny_hf_model`) as llama.cpp would: GGUF names,
    q/k rows interleaved for the "llama" architecture, metadata and a byte-level tokenizer.
    quant "Q8_0" (or any type `gguf.quants.quantize` writes) stores the matrices quantized
    (norms and biases stay F32). `raw` {gguf name: (uint8 blocks, GGML type)} stores those
    tensors' bytes as given instead."""
    import gguf

    config = hf_model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokenizer = byte_level_tokenizer()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float()
        if arch == "llama" and ".q_proj." in name:
            data = rope_interleave(data, config.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            data = rope_interleave(data, config.num_key_value_heads)
        array = data.numpy()
        if raw is not None and gguf_name(name) in raw:
            blocks, raw_type = raw[gguf_name(name)]
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=raw_type)
        elif quant != "F32" and array.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, quant)
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_copy(hf_model: Any, quant: str) -> Any:
    """A copy of `hf_model` whose matrices went through `quant` and back (the GGUF's values)."""
    import copy

    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, quant)
    clone = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param in clone.parameters():
            if param.ndim == 2:
                packed = gguf.quants.quantize(param.numpy(), qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(packed, qtype)))
    return clone
