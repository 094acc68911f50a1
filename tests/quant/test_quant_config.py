"""The quantization options as every other engine option: fields of EngineConfig, read from
PLUGSERVE_* variables, a wrong value refused with the allowed ones."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plugserve.config import EngineConfig


def test_defaults_keep_what_the_model_stores_with_int8_activations() -> None:
    config = EngineConfig()
    assert config.quantization is None and config.quant_activations == "int8"


def test_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGSERVE_QUANTIZATION", "q4_k")
    monkeypatch.setenv("PLUGSERVE_QUANT_ACTIVATIONS", "float")
    config = EngineConfig()
    assert config.quantization == "q4_k" and config.quant_activations == "float"


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("quantization", "q3_k", "'q8_0', 'q4_0', 'q4_k' or 'none'"),
    ("quant_activations", "fp8", "'int8' or 'float'"),
])
def test_a_wrong_value_lists_the_allowed_ones(field: str, value: str, allowed: str) -> None:
    with pytest.raises(ValidationError, match=allowed):
        EngineConfig(**{field: value})


def test_quantization_on_load_is_refused_on_a_gpu() -> None:
    with pytest.raises(ValidationError, match="runs on the CPU only for now"):
        EngineConfig(quantization="q8_0", device="cuda")
    assert EngineConfig(quantization="none", device="cuda").quantization == "none"
