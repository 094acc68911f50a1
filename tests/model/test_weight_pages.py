"""The weights moved onto one huge-page arena after loading (plugserve.model.weight_pages):

- every parameter and every quantized part then lives in the one arena, with the same values,
  tied parameters still sharing one copy and shared quantized parts one copy;
- the engine's greedy tokens are transformers' (dense) and those of the unmoved model
  (a Q4_1 GGUF through the compiled decode stack) with the weights moved, checker at level 1
  with the physical page checks, under the normal and the overlap loop;
- nothing moves with PLUGSERVE_HUGE_PAGES=0, where the kernel has no huge pages, or for a
  model under the size limit; /proc/self/smaps is read for the huge-page backing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plugserve.model import weight_pages
from plugserve.model.quant_weight import WeightHolder
from plugserve.pools import huge_pages
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve.testing.reference import hf_greedy, random_prompts

from .conftest import tiny_hf_model, write_tiny_gguf

PROMPTS = random_prompts(3, 256, 4, 24, seed=31)
MAX_NEW = [10, 5, 14]

needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason="no transparent huge pages on this system")


def _sampling() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]


def _every_tiny_model_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_pages, "MIN_MODEL_BYTES", 0)


class TestWeightPages(EngineTest):
    def _greedy(self, **config: Any) -> tuple[list[list[int]], Any]:
        with self.engine(**config) as engine:
            got = [r.token_ids for r in engine.generate(PROMPTS, _sampling())]
            self.assert_idle_memory_whole(engine)
            return got, engine.weight_placement

    @needs_thp
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_dense_model_moved_gives_transformers_tokens(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
    ) -> None:
        _every_tiny_model_moves(monkeypatch)
        tiny_hf_model("llama", tmp_path, seed=3, tie_word_embeddings=True)
        expected = hf_greedy(tmp_path, PROMPTS, MAX_NEW)
        got, placement = self._greedy(model=str(tmp_path), overlap=overlap)
        assert placement.arena_bytes > 0, placement.reason
        assert got == expected

    @needs_thp
    @pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
    def test_quantized_model_moved_gives_the_unmoved_tokens(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
    ) -> None:
        hf = tiny_hf_model("llama", tmp_path / "hf", seed=8)
        write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant="Q4_1")
        monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
        unmoved, placement = self._greedy(model=str(tmp_path / "tiny.gguf"), overlap=overlap)
        assert placement.arena_bytes == 0 and "PLUGSERVE_HUGE_PAGES" in placement.reason
        monkeypatch.delenv(huge_pages.ENV_SWITCH)
        _every_tiny_model_moves(monkeypatch)
        moved, placement = self._greedy(model=str(tmp_path / "tiny.gguf"), overlap=overlap)
        assert placement.arena_bytes > 0, placement.reason
        assert moved == unmoved


@needs_thp
def test_every_weight_lands_in_one_arena_with_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plugserve.model import load_model

    _every_tiny_model_moves(monkeypatch)
    hf = tiny_hf_model("llama", tmp_path / "hf", seed=2, tie_word_embeddings=True)
    write_tiny_gguf(hf, tmp_path / "tiny.gguf", quant="Q8_0")
    for source in (tmp_path / "hf", tmp_path / "tiny.gguf"):
        model = load_model(str(source), dtype=torch.float32, device="cpu").model
        before = {name: p.detach().clone() for name, p in model.named_parameters()
                  if p.device.type == "cpu"}
        holders = [m for m in model.modules() if isinstance(m, WeightHolder) and m.quant]
        blocks_before = [[part.data.clone() for part in h.quant or ()] for h in holders]
        placement = weight_pages.place_on_huge_pages(model)
        assert placement.arena_bytes > 0, placement.reason
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()
                    if p.device.type == "cpu"}
        for h in holders:
            storages |= {part.data.untyped_storage().data_ptr() for part in h.quant or ()}
        assert len(storages) == 1  # one arena
        for name, p in model.named_parameters():
            if name in before:
                assert torch.equal(p, before[name]), name
        for h, old in zip(holders, blocks_before, strict=True):
            assert [torch.equal(part.data, o) for part, o in zip(h.quant or (), old,
                                                                  strict=True)] == [True] * len(old)
        if source.suffix != ".gguf":  # the tied head still is the embedding
            assert model.lm_head_holder.matrix.data_ptr() == model.embed_tokens.weight.data_ptr()
        # in 64-byte steps: every tensor starts on a cache line
        for p in model.parameters():
            if p.device.type == "cpu":
                assert p.data_ptr() % huge_pages.ALIGN_BYTES == 0


def test_nothing_moves_when_switched_off_or_small_or_without_thp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plugserve.model import load_model

    tiny_hf_model("llama", tmp_path, seed=1)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    pointers = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setattr(weight_pages, "MIN_MODEL_BYTES", 1 << 40)
    assert weight_pages.place_on_huge_pages(model).arena_bytes == 0
    monkeypatch.setattr(weight_pages, "MIN_MODEL_BYTES", 0)
    monkeypatch.setattr(huge_pages, "thp_setting", lambda: "never")
    placement = weight_pages.place_on_huge_pages(model)
    assert placement.arena_bytes == 0 and "never" in placement.reason
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    assert weight_pages.place_on_huge_pages(model).arena_bytes == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_thp_setting_and_smaps_are_read(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.thp_setting(setting) == "madvise"
    assert huge_pages.thp_setting(tmp_path / "missing") is None
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000600000 rw-p 00000000 00:00 0\n"
        "Size:               6144 kB\n"
        "AnonHugePages:      4096 kB\n"
        "7f0000600000-7f0000800000 rw-p 00000000 00:00 0\n"
        "AnonHugePages:      2048 kB\n"
        "7f0000900000-7f0000a00000 rw-p 00000000 00:00 0\n"
        "AnonHugePages:      1024 kB\n"
    )
    base = 0x7F0000000000
    assert huge_pages.huge_bytes_at(base, 0x800000, smaps) == 6144 * 1024
    assert huge_pages.huge_bytes_at(base + 0x100000, 0x100000, smaps) == 0x100000  # capped
    assert huge_pages.huge_bytes_at(base + 0x900000, 0x10, smaps) == 16
    assert huge_pages.huge_bytes_at(base, 16, tmp_path / "missing") is None
