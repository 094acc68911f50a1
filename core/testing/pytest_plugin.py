"""pytest plugin registered by plugserve: fixtures every plugin's test suite can use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model folder (weights, config, tokenizer), built once a session."""
    from plugserve.testing.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)
