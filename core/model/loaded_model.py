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
