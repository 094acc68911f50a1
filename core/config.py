"""Engine configuration: one pydantic-settings model, read from arguments and `PLUGSERVE_*`.

Only values that are wrong on their own are checked here; combinations that depend on the
selected plugins (a backend's page sizes, topk>1 support, ...) are checked by
`plugserve.validation.validate_config`, which gathers every reason at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from plugserve.fixes import ENV_VAR as REVERT_FIX_ENV
from plugserve.fixes import parse_reverts

DType = Literal["float32", "bfloat16", "float16"]
# What the KV pools store (vLLM / SGLang names); "auto" = the model's dtype.
KVCacheDType = Literal["auto", "float32", "bfloat16", "float8_e4m3", "float8_e5m2"]
Quantization = Literal["q8_0", "q4_0", "q4_k", "none"]
QuantActivations = Literal["int8", "float"]


class EngineConfig(BaseSettings):
    """Everything the engine needs to start. Field names map to `PLUGSERVE_<NAME>` variables."""

    model_config = SettingsConfigDict(env_prefix="PLUGSERVE_", extra="forbid", frozen=True)

    # What to run.
    model: str | None = Field(
        default=None, description="HF model folder or .gguf file; None = built-in SmolLM2-135M"
    )
    tokenizer: str | None = Field(default=None, description="tokenizer folder, if not the model's")
    dtype: DType = "float32"
    device: str = "cpu"
    seed: int = 0

    # Plugins, picked by name.
    attention: str = "torch_native"
    cache: str = "radix"
    spec: str = "none"
    grammar_backend: str = Field(
        default="xgrammar", description="grammar backend for structured outputs (plugin name)"
    )
    plugins: str | None = Field(
        default=None,
        description="comma-separated allowlist of external plugins to load; '' = built-ins only",
    )

    # Quantized weights (plugserve.quant).
    quantization: Quantization | None = Field(
        default=None,
        description="None = as the model stores them (a GGUF's quantized tensors stay "
        "quantized); none = dequantize a GGUF; q8_0 / q4_0 / q4_k = quantize an HF folder's "
        "matrices on load",
    )
    quant_activations: QuantActivations = Field(
        default="int8",
        description="how quantized matmuls take their input: int8 (rounded per 32-block, as "
        "llama.cpp) or float (the compute dtype: token-identical to the dequantized model)",
    )

    # Memory.
    page_size: int = Field(default=1, ge=1, le=256)
    max_running_requests: int = Field(default=64, ge=1, description="request rows in req_to_token")
    kv_pool_tokens: int | None = Field(
        default=None, ge=1, description="KV slots per pool (tokens); None = sized from context"
    )
    context_len: int | None = Field(default=None, ge=2, description="max tokens per request")
    kv_cache_dtype: KVCacheDType = Field(
        default="auto",
        description="what the KV pools store: auto (the model's dtype), float32 (a model run "
        "in float32 only, unless the backend reads it), bfloat16, float8_e4m3 or float8_e5m2 "
        "(widened to the model's dtype as attention reads it)",
    )
    # Hybrid sliding-window models (plugserve.pools.swa_pool): windowed layers' KV in its own pool.
    swa_pools: bool = Field(
        default=True,
        description="give a sliding-window model's windowed layers their own KV pool that "
        "frees what falls out of the window; False = one full pool with a window mask",
    )
    swa_pool_tokens: int | None = Field(
        default=None,
        description="KV slots of the sliding-window pool; None = max_running_requests x "
        "(window + speculative reserve + 2 pages) + one prefill chunk, capped by the full pool",
    )

    # Scheduling.
    chunked_prefill_size: int = Field(
        default=2048, ge=0, description="prefill token budget per step; 0 = no chunking"
    )
    max_prefill_tokens: int = Field(default=8192, ge=1)
    enable_mixed_chunk: bool = False
    overlap: bool = False

    # Speculative decoding (used by spec plugins).
    draft_model: str | None = None
    spec_steps: int = Field(default=3, ge=1)
    spec_topk: int = Field(default=1, ge=1)
    spec_draft_tokens: int | None = Field(default=None, ge=1)

    # Tensor parallelism (plugserve.parallel): the model's heads, MLP and vocabulary split over
    # tp_size ranks, each holding its own KV pools for its heads.
    tp_size: int = Field(
        default=1, ge=1,
        description="tensor-parallel ranks; > 1 starts the other ranks (or joins torchrun's)",
    )
    tp_backend: str | None = Field(
        default=None,
        description="torch.distributed backend of the model's collectives; None = gloo on the "
        "CPU, nccl on CUDA",
    )
    tp_shm_all_reduce: bool = Field(
        default=True,
        description="on the CPU with every rank on this machine, sum the model's all-reduces "
        "through shared memory (microseconds) instead of the backend (gloo: ~1 ms each)",
    )
    tp_timeout_s: float = Field(
        default=120.0, gt=0,
        description="seconds a busy rank waits for the others in a collective before it fails",
    )

    # Accounting checks.
    mem_check: int = Field(default=0, ge=0, le=2, description="0 off, 1 quiet, 2 verbose")
    check_pages: bool = False
    mem_check_ring_size: int = Field(default=64, ge=1)

    # Fix toggles to revert (tests only): resolved once here, never read from the environment
    # on a hot path. `PLUGSERVE_REVERT_FIX=a,b` or `revert_fixes={"a", "b"}`.
    revert_fixes: Annotated[frozenset[str], NoDecode] = Field(
        default=frozenset(),
        validation_alias=AliasChoices("revert_fixes", REVERT_FIX_ENV),
        description="names of fixed accounting bugs to put back (see plugserve.fixes)",
    )

    @field_validator("revert_fixes", mode="before")
    @classmethod
    def _split_reverts(cls, value: Any) -> frozenset[str]:
        return parse_reverts(value)

    @field_validator("swa_pool_tokens")
    @classmethod
    def _positive_swa_pool(cls, value: int | None) -> int | None:
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise ValueError(
                f"swa_pool_tokens must be a positive number of KV slots (or unset for the "
                f"default size), got {value!r}"
            )
        return value

    @field_validator("tp_backend")
    @classmethod
    def _known_tp_backend(cls, value: str | None) -> str | None:
        if value is not None and value not in ("gloo", "nccl"):
            raise ValueError(f"tp_backend must be 'gloo' or 'nccl' (or unset), got {value!r}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.chunked_prefill_size and self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be 0 (off) or at least "
                f"page_size ({self.page_size})"
            )
        if self.quantization not in (None, "none") and not self.device.startswith("cpu"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only for now (device="
                f"{self.device!r}); leave it unset on a GPU (a GGUF's blocks are dequantized "
                "there)"
            )
        if self.enable_mixed_chunk and not self.chunked_prefill_size:
            raise ValueError("enable_mixed_chunk needs chunked prefill (chunked_prefill_size > 0)")
        if self.spec == "none":
            stray = [
                name for name, on in (
                    ("draft_model", self.draft_model is not None),
                    ("spec_topk", self.spec_topk != 1),
                    ("spec_draft_tokens", self.spec_draft_tokens is not None),
                ) if on
            ]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} set without a speculative algorithm (spec='none'): "
                    "choose one with spec (--spec eagle) or leave them unset"
                )
        if self.spec != "none" and self.enable_mixed_chunk:
            raise ValueError(
                f"enable_mixed_chunk cannot be combined with speculative decoding (spec="
                f"{self.spec!r}): a speculative round runs on its own; turn one of them off"
            )
        if self.spec_draft_tokens is not None:
            if self.spec_topk == 1 and self.spec_draft_tokens != self.spec_steps + 1:
                raise ValueError(
                    f"spec_draft_tokens={self.spec_draft_tokens} with spec_topk=1: a chain "
                    f"verifies exactly spec_steps + 1 = {self.spec_steps + 1} tokens; leave it "
                    "unset or use spec_topk > 1"
                )
            most = 1 + self.spec_topk + (self.spec_steps - 1) * self.spec_topk**2
            if self.spec_topk > 1 and not 2 <= self.spec_draft_tokens <= most:
                raise ValueError(
                    f"spec_draft_tokens={self.spec_draft_tokens} must be between 2 and {most} "
                    f"(the root plus the tree nodes that spec_steps={self.spec_steps} steps of "
                    f"spec_topk={self.spec_topk} can draft)"
                )
        return self

    @property
    def num_draft_tokens(self) -> int:
        """Tree nodes sent to verify; a chain (topk 1) always sends num_steps + 1."""
        if self.spec_topk == 1:
            return self.spec_steps + 1
        return self.spec_draft_tokens or self.spec_steps * self.spec_topk
