from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)
