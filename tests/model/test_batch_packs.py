"""The server's start packs the weights for the batch and prefill linears, so no request
waits on them, and counts the packs' bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.engine import Engine
from plugserve.kernels import build, packed_linear
from plugserve.kernels import panel_gemm as panel
from plugserve.model.batch_packs import make_batch_packs
from plugserve.model.layers import Linear
from plugserve.model.weight_bytes import pack_bytes
from plugserve.sampling import SamplingParams
from plugserve.testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


def _packs() -> dict[int, int]:
    """The panel GEMM's cached packs for the ISA in use: weight id -> id of its pack."""
    library = build.library()
    assert library is not None
    store = panel._packs.get(library.isa(), {})
    return {key: id(entry[2]) for key, entry in store.items()}


def _library_packs() -> dict[int, int]:
    """The GEMM library's cached packs (many-row linears): weight id -> id of its pack."""
    return {key: id(entry[2]) for key, entry in packed_linear._packs.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_float32_weights_are_packed_before_the_first_batch(tiny_llama: Path, overlap: bool) -> None:
    if build.library() is None:
        pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
    engine = Engine(model=str(tiny_llama), dtype="float32", mem_check=1, check_pages=True,
                    overlap=overlap)
    try:
        model = engine.model
        linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
        head = model.lm_head_holder.weight
        # the LM head keeps its many-row pack lazy (a prefill multiplies only its last row)
        library_packed = [w for w in linears
                          if w is not head and packed_linear.pack_kind(w) is not None]
        assert pack_bytes(model) == 0  # nothing has run yet
        expected = len(linears) + (0 if any(head is w for w in linears) else 1)
        assert make_batch_packs(model) == expected + len(library_packed)
        packed, library = _packs(), _library_packs()
        assert all(id(w) in packed for w in [*linears, head])
        assert all(id(w) in library for w in library_packed)
        # float32: the panel pack and the library's pack each hold about the weight's bytes
        weights = sum(w.numel() * w.element_size() for w in {id(w): w for w in
                                                              [*linears, head]}.values())
        library_bytes = sum(w.numel() * w.element_size() for w in library_packed)
        assert weights + library_bytes <= pack_bytes(model) <= 1.25 * (weights + library_bytes)
        # A batch past the few-row kernels, and the prefill of prompts of more rows than the
        # kernels for few rows take, find every pack made: none is added or redone.
        prompts = [[1 + i, 2 + i, 3 + i] for i in range(panel.MIN_ROWS + 3)]
        prompts.append(list(range(1, 200)))
        out = engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out) == len(prompts)
        assert _packs() == packed
        assert _library_packs() == library
    finally:
        engine.close()


def test_nothing_is_packed_without_the_kernels(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(model=str(tiny_llama), dtype="float32", mem_check=1, check_pages=True)
    try:
        monkeypatch.setattr(build, "library", lambda: None)
        monkeypatch.setattr(packed_linear, "_ENABLED", False)  # PLUGSERVE_CPU_KERNELS=0
        assert make_batch_packs(engine.model) == 0
        assert pack_bytes(engine.model) == 0
    finally:
        engine.close()
