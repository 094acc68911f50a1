"""LoadedModel: what every loader hands back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plugserve.model.arch import ModelArchConfig
from plugserve.model.llama import CausalLM
from plugserve.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    source: Path  # the HF folder or .gguf file the weights were read from
    # One tensor-parallel rank's shape (its heads, MLP columns and vocabulary rows); None
    # when this process holds the whole model.
    shard_arch: ModelArchConfig | None = None

    @property
    def rank_arch(self) -> ModelArchConfig:
        """The shape this process holds: what its KV pool and attention backend are sized
        from."""
        return self.shard_arch or self.arch
