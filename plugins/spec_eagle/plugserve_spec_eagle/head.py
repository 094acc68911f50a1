"""The EAGLE draft head: one decoder layer that runs on the target's features.

At draft position i the head reads the embedding of token t_{i+1} and the target's
pre-final-norm hidden state f_i, fuses them with `fc` (2*hidden -> hidden), runs one
Llama decoder layer (rope position i) and returns its output hidden state, a prediction of
f_{i+1}. Its logits (a prediction of t_{i+2}) come from the target's own final norm and LM
head, restricted to the draft vocabulary: draft index j is target token `d2t[j]`.

The head owns `fc`, its decoder layer and the `d2t` table; it shares the target's embedding,
final norm and LM head (they are neither copied nor saved). The decoder layer is the core
`DecoderLayer` with `layer_id=0`, so a paged forward attends through any attention backend
over a draft KV pool whose only layer id is 0. `forward_dense` runs the same layer with
plain causal attention over padded [B, T] batches, for training.

On disk a head is a folder with `config.json` (marked `"plugserve_head": "eagle"`) and
`model.safetensors` (the owned parameters and `d2t`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plugserve.attention.base import AttentionBackend, AttentionLayer
from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.layers import Device, Linear, linear
from plugserve.model.llama import CausalLM, DecoderLayer
from plugserve.model.quant_on_load import quantize_layers, quantizes_on_load
from plugserve.model.rope import RotaryEmbedding
from plugserve.quant.reference import Activations
from plugserve.structs.forward_batch import ForwardBatch
from plugserve_spec_eagle.tp_vocab import DraftVocabShard

HEAD_MARKER = "eagle"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
SAVE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class EagleHeadLoadError(ModelLoadError):
    """An EAGLE head folder could not be loaded; the message names the path and the problem."""


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # The draft layer's variant; `from_target` gives a plain Llama layer.
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02  # std of the random initialisation

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, target_vocab_size={self.target_vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        self.layer_arch()  # validates the sizes with ModelArchConfig's checks

    @classmethod
    def from_target(
        cls, arch: ModelArchConfig, draft_vocab_size: int | None = None
    ) -> EagleHeadConfig:
        """A head sized for `arch`; `draft_vocab_size` None = the full target vocabulary."""
        return cls(
            hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size,
            rms_norm_eps=arch.rms_norm_eps,
            rope_theta=arch.rope_theta,
            rope_scaling=None if arch.rope_scaling is None else dict(arch.rope_scaling),
            max_position_embeddings=arch.max_position_embeddings,
            target_vocab_size=arch.vocab_size,
            draft_vocab_size=arch.vocab_size if draft_vocab_size is None else draft_vocab_size,
        )

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.target_vocab_size

    def layer_arch(self) -> ModelArchConfig:
        """A one-layer Llama `ModelArchConfig` describing the draft decoder layer."""
        return ModelArchConfig(
            model_type="llama",
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            qk_norm=self.qk_norm,
            layer_sliding_window=(None,),
        )

    def to_json_dict(self) -> dict[str, Any]:
        return {"plugserve_head": HEAD_MARKER, "format_version": FORMAT_VERSION,
                **dataclasses.asdict(self)}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], *, source: str = "config") -> EagleHeadConfig:
        marker = data.get("plugserve_head")
        if marker != HEAD_MARKER:
            raise EagleHeadLoadError(
                f"{source}: not a plugserve EAGLE head config (\"plugserve_head\" is "
                f"{marker!r}, expected {HEAD_MARKER!r}); is this the target model's folder?"
            )
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise EagleHeadLoadError(
                f"{source}: head format_version {version!r} is not supported "
                f"(this plugserve reads {FORMAT_VERSION})"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise EagleHeadLoadError(f"{source}: missing field(s) {', '.join(missing)}")
        unknown = sorted(data.keys() - names - {"plugserve_head", "format_version"})
        if unknown:
            raise EagleHeadLoadError(f"{source}: unknown field(s) {', '.join(unknown)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, ValueError) as exc:
            raise EagleHeadLoadError(f"{source}: invalid head configuration: {exc}") from exc

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / CONFIG_FILE
        path.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> EagleHeadConfig:
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise EagleHeadLoadError(f"{path}: missing; an EAGLE head folder needs a {CONFIG_FILE}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EagleHeadLoadError(f"{path}: cannot read JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise EagleHeadLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_json_dict(data, source=str(path))


@dataclass
class EagleHeadOutput:
    logits: torch.Tensor  # float32 [rows, draft_vocab]
    hidden: torch.Tensor  # [rows, hidden], the predicted next target feature (pre final norm)


class _DenseCausalAttention:
    """Stands in for an attention backend in `forward_dense`: plain causal attention over a
    padded [batch, seq_len] layout, no KV cache. Right padding never leaks into real rows."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch = batch
        self.seq_len = seq_len

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        forward_batch: object,
    ) -> torch.Tensor:
        b, t = self.batch, self.seq_len
        out = F.scaled_dot_product_attention(
            q.view(b, t, layer.num_heads, layer.head_dim).transpose(1, 2),
            k.view(b, t, layer.num_kv_heads, layer.head_dim).transpose(1, 2),
            v.view(b, t, layer.num_kv_heads, layer.head_dim).transpose(1, 2),
            is_causal=True, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(b * t, layer.num_heads, layer.head_dim)


class EagleHead(nn.Module):
    target: CausalLM  # shared, not a submodule
    d2t: torch.Tensor

    def __init__(
        self, config: EagleHeadConfig, target: CausalLM, *, dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
    ) -> None:
        super().__init__()
        check_compatible(config, target.arch, source="EAGLE head")
        self.config = config
        self.dtype = dtype
        # Plain attribute: the target's parameters stay out of this module's state.
        self.__dict__["target"] = target
        arch = config.layer_arch()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=False, dtype=dtype,
                         device=device)
        self.layer = DecoderLayer(arch, arch.attention_layers()[0], dtype, device)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, dtype=dtype, device=device,
        )
        self.register_buffer(
            "d2t", torch.arange(config.draft_vocab_size, dtype=torch.int64, device=device)
        )
        self._draft_lm_weight: torch.Tensor | None = None
        self._vocab_shard: DraftVocabShard | None = None

    @property
    def device(self) -> torch.device:
        return self.d2t.device  # fc.weight is a placeholder once quantized

    @property
    def attention_layer(self) -> AttentionLayer:
        """The layer the backend sees (layer_id 0): size the draft KV pool from it."""
        return self.layer.self_attn.layer

    # ---- initialisation and the draft vocabulary -------------------------------------------

    def init_weights(self, seed: int) -> None:
        """Seeded random init: matrices ~ N(0, initializer_range), biases 0, norms 1."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                    param.copy_(noise * std)

    def set_d2t(self, d2t: torch.Tensor | list[int]) -> None:
        """Set the draft index -> target token table (strictly increasing target ids)."""
        table = torch.as_tensor(d2t, dtype=torch.int64).to(self.d2t.device)
        n, vocab = self.config.draft_vocab_size, self.config.target_vocab_size
        if table.shape != (n,):
            raise ValueError(f"d2t must have shape ({n},), got {tuple(table.shape)}")
        if n and (int(table.min()) < 0 or int(table.max()) >= vocab):
            raise ValueError(f"d2t holds token ids outside the target vocabulary (0..{vocab - 1})")
        if n > 1 and not bool((table[1:] > table[:-1]).all()):
            raise ValueError("d2t must list distinct target token ids in increasing order")
        with torch.no_grad():
            self.d2t.copy_(table)
        # Select now rather than lazily inside some later inference_mode forward.
        self._draft_lm_weight = self._select_lm_weight()

    def _select_lm_weight(self) -> torch.Tensor:
        weight = self.target.dense_lm_head_weight().detach()
        shard = getattr(self.target, "shard", None)  # a tensor-parallel target's rank
        if shard is not None:
            ids = self.d2t if self.config.reduced_vocab else torch.arange(
                self.config.target_vocab_size)
            self._vocab_shard = DraftVocabShard.build(shard, ids)
            return self._vocab_shard.weight(weight).contiguous()
        if self.config.reduced_vocab:
            weight = weight.index_select(0, self.d2t.to(weight.device)).contiguous()
        return weight

    def draft_lm_weight(self) -> torch.Tensor:
        """The target's LM head rows of the draft vocabulary, [draft_vocab, hidden] (cached;
        `set_d2t` refreshes it)."""
        if self._draft_lm_weight is None:
            self._draft_lm_weight = self._select_lm_weight()
        return self._draft_lm_weight

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to target token ids (same shape)."""
        return self.d2t[draft_ids]

    # ---- forwards ----------------------------------------------------------------------------

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 draft-vocabulary logits of head output states (target's norm and LM head)."""
        target_dtype = self.target.dtype
        normed = self.target.final_norm(hidden.to(target_dtype))
        logits = linear(normed, self.draft_lm_weight(), None, out_dtype=torch.float32)
        if self._vocab_shard is not None:  # this rank's entries: gather the others'
            logits = self._vocab_shard.gather(logits)
        return logits

    def _fuse(self, input_ids: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            embedded = self.target.embed(input_ids)
        return self.fc(torch.cat((embedded.to(self.dtype), hidden_in.to(self.dtype)), dim=-1))

    def forward(
        self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
    ) -> EagleHeadOutput:
        """Paged forward: `fb.input_ids` are t_{i+1}, `hidden_in` [num_tokens, hidden] are f_i,
        `fb.positions` the draft positions i; K/V go to `fb.kv_pool` (layer id 0)."""
        if hidden_in.shape != (fb.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden_in must be [{fb.num_tokens}, {self.config.hidden_size}], "
                f"got {list(hidden_in.shape)}"
            )
        hidden = self._fuse(fb.input_ids, hidden_in)
        cos, sin = self.rotary(fb.positions)
        hidden = self.layer(hidden, cos, sin, fb, backend)
        if fb.logits_indices is not None:
            hidden = hidden.index_select(0, fb.logits_indices)
        return EagleHeadOutput(self.compute_logits(hidden), hidden)

    def forward_dense(
        self, input_ids: torch.Tensor, hidden_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward over a right-padded batch: input_ids [B, T], hidden_in [B, T, H]
        -> (hidden_out [B, T, H], logits [B, T, draft_vocab] float32); positions 0..T-1."""
        batch, seq_len = input_ids.shape
        if hidden_in.shape != (batch, seq_len, self.config.hidden_size):
            raise ValueError(
                f"hidden_in must be [{batch}, {seq_len}, {self.config.hidden_size}], "
                f"got {list(hidden_in.shape)}"
            )
        hidden = self._fuse(input_ids.reshape(-1), hidden_in.reshape(batch * seq_len, -1))
        positions = torch.arange(seq_len, device=input_ids.device).repeat(batch)
        cos, sin = self.rotary(positions)
        hidden = self.layer(hidden, cos, sin, None, _DenseCausalAttention(batch, seq_len))
        logits = self.compute_logits(hidden)
        return hidden.view(batch, seq_len, -1), logits.view(batch, seq_len, -1)


# ---- compatibility, save and load ---------------------------------------------------------


def check_compatible(config: EagleHeadConfig, arch: ModelArchConfig, *, source: str) -> None:
    """Raise EagleHeadLoadError naming every size where the head does not fit the target."""
    pairs = [
        ("hidden_size", config.hidden_size, arch.hidden_size),
        ("vocab size", config.target_vocab_size, arch.vocab_size),
    ]
    problems = [f"{name} {mine} but the target has {theirs}"
                for name, mine, theirs in pairs if mine != theirs]
    if problems:
        raise EagleHeadLoadError(
            f"{source} does not fit the target model: head " + "; ".join(problems)
        )


def save_head(head: EagleHead, folder: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `config.json` and `model.safetensors` (owned parameters in `dtype`, plus d2t)."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        value = tensor.detach()
        if value.is_floating_point():
            value = value.to(SAVE_DTYPES[dtype])
        state[name] = value.to("cpu").contiguous()
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "plugserve_head": "eagle"})
    head.config.save(out)
    return out


def load_head(
    folder: str | Path, target: CausalLM, *, dtype: torch.dtype = torch.float32,
    device: Device = "cpu", quantization: str | None = None,
    quant_activations: Activations = "int8",
) -> EagleHead:
    """Read a head saved by `save_head` for `target`; errors name the path and the problem.
    `quantization` q8_0 / q4_0 / q4_k quantizes its matrices after loading."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise EagleHeadLoadError(f"{root}: EAGLE head folder does not exist (or is not a folder)")
    config = EagleHeadConfig.load(root)
    check_compatible(config, target.arch, source=f"{root}")
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise EagleHeadLoadError(f"{weights}: missing; an EAGLE head folder needs {WEIGHTS_FILE}")
    head = EagleHead(config, target, dtype=dtype, device=device)
    expected = head.state_dict()
    with safe_open(str(weights), framework="pt") as handle:
        names = set(handle.keys())
        missing = sorted(set(expected) - names)
        unknown = sorted(names - set(expected))
        if missing or unknown:
            raise EagleHeadLoadError(
                f"{weights}: tensor names do not match the head"
                + (f"; missing {missing}" if missing else "")
                + (f"; unexpected {unknown}" if unknown else "")
            )
        with torch.no_grad():
            for name, param in expected.items():
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise EagleHeadLoadError(
                        f"{weights}: tensor {name} has shape {list(tensor.shape)}, the head "
                        f"configuration needs {list(param.shape)}"
                    )
                if name == "d2t":
                    continue
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        d2t = handle.get_tensor("d2t")
    try:
        head.set_d2t(d2t)
    except ValueError as exc:
        raise EagleHeadLoadError(f"{weights}: {exc}") from exc
    if quantizes_on_load(quantization):
        assert quantization is not None
        try:
            quantize_layers(head, quantization, quant_activations, str(root))
        except ModelLoadError as exc:
            raise EagleHeadLoadError(str(exc)) from exc
    return head
