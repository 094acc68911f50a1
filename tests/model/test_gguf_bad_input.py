"""A malformed GGUF is a `ModelLoadError` naming the file and the tensor, never a crash: a
file that ends inside a tensor's data, a tensor whose recorded shape is not a whole number
of its blocks, one whose block count does not match the shape the model needs, and an
architecture the engine does not implement."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import load_model
from plugserve.model.errors import ModelLoadError, UnsupportedArchitectureError

from .conftest import write_tiny_gguf

Models = dict[str, tuple[Path, Any]]
TENSOR = "blk.0.attn_output.weight"


@pytest.fixture
def q8_file(tiny_models: Models, tmp_path: Path) -> Path:
    _, hf = tiny_models["llama"]
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, quant="Q8_0")
    return path


def _load(path: Path) -> None:
    load_model(str(path), dtype=torch.float32, device="cpu")


def _with_columns(path: Path, out: Path, tensor: str, cols: int) -> Path:
    """A copy of `path` whose tensor record says `tensor` has `cols` columns (GGUF's first
    dimension): its name, n_dims (uint32), then dims (uint64 each)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor) + 4
    old = struct.unpack_from("<Q", data, at)[0]
    assert old == 64
    struct.pack_into("<Q", data, at, cols)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.99])
def test_a_truncated_file_names_the_tensor_it_ends_in(q8_file: Path, tmp_path: Path,
                                                      keep: float) -> None:
    data = q8_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=rf"{cut}: .*tensor '[\w.]+'.*truncated"):
        _load(cut)


def test_a_truncated_header_is_a_clear_error(q8_file: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q8_file.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match=rf"{cut}: cannot read as GGUF"):
        _load(cut)


def test_a_row_that_is_not_whole_blocks_names_the_tensor(q8_file: Path,
                                                         tmp_path: Path) -> None:
    bad = _with_columns(q8_file, tmp_path / "bad.gguf", TENSOR, 40)  # 40 % 32 != 0
    with pytest.raises(ModelLoadError, match=rf"{bad}: .*tensor '{TENSOR}'.*Q8_0"):
        _load(bad)


def test_a_block_count_that_does_not_match_the_shape_names_the_tensor(
    q8_file: Path, tmp_path: Path
) -> None:
    bad = _with_columns(q8_file, tmp_path / "bad.gguf", TENSOR, 96)  # 3 blocks a row, not 2
    with pytest.raises(ModelLoadError, match=rf"{bad}: .*o_proj.weight.*\(64, 96\)"):
        _load(bad)


def test_an_unsupported_architecture_names_the_file(q8_file: Path, tmp_path: Path) -> None:
    data = q8_file.read_bytes()
    bad = tmp_path / "arch.gguf"
    bad.write_bytes(data.replace(b"llama", b"llamx", 1))  # general.architecture's value
    with pytest.raises(UnsupportedArchitectureError, match=rf"{bad}: .*llamx"):
        _load(bad)
