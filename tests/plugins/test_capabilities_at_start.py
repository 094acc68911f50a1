"""Capabilities that depend on the model are consulted once its config is read: a backend
without sliding-window support is refused for a model with sliding-window layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plugserve.attention.base import BackendCapabilities
from plugserve.engine import Engine, EngineStartError
from plugserve.hookspecs import hookimpl
from plugserve.sampling import SamplingParams
from plugserve.testing.tiny_models import make_tiny_model_dir


def _torch_native() -> Any:
    from plugserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend


def _no_window_plugin() -> SimpleNamespace:
    def attention(register: Any) -> None:
        register("no_window", _torch_native, BackendCapabilities(sliding_window=False))

    return SimpleNamespace(plugserve_register_attention_backends=hookimpl(attention))


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral_window"), arch="mistral",
                               seed=0, sliding_window=8)


def test_a_backend_without_windows_is_refused_for_a_windowed_model(
    fake_plugins: Callable[..., None], windowed_model: Path, tiny_model_dir: Path
) -> None:
    import plugserve_checker.plugin as checker

    fake_plugins(no_window=_no_window_plugin(), checker=checker)
    with pytest.raises(EngineStartError, match=r"sliding-window layers; attention backend "
                                               r"'no_window' does not support sliding windows"):
        Engine(model=str(windowed_model), attention="no_window")
    # The same backend serves a model without windows.
    with Engine(model=str(tiny_model_dir), attention="no_window", mem_check=1,
                check_pages=True) as engine:
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
        assert out.output_tokens == 2
