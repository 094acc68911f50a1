"""The whole engine on CPU with this backend, its kernels replaced by the CPU interpreter.

Only the kernels differ from a CUDA run: the engine builds the backend through its registry
entry, the scheduler, prefix cache, chunked prefill, paged memory (checker on) and EAGLE's
tree drafting drive `init_forward_metadata` and the wrappers exactly as on a GPU. The entry
is patched for the test to allow the CPU and float32 and to build the backend with
`kernels=reference`. Greedy output equals torch_native's; EAGLE tree drafting (topk 4, the
holey layout on pages of 16 and of 4 under the overlap loop) equals plain greedy decoding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from plugserve.attention.base import AttentionContext
from plugserve.config import EngineConfig
from plugserve.plugins import load_plugins
from plugserve.sampling import SamplingParams
from plugserve.testing import EngineTest
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend

NAME = "flashinfer"
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 23, 40])]
PROMPTS.append([*PROMPTS[2][:30], 9, 8, 7])  # shares a cached prefix with prompt 2
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class _Interpreted(FlashInferAttentionBackend):
    """The backend as the engine builds it (`cls(ctx)`), with the CPU interpreter as kernels."""

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx, kernels=reference)


@pytest.fixture(scope="module")
def trained_head(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    testing = pytest.importorskip("plugserve_spec_eagle.testing")
    path: Path = testing.make_tiny_head_dir(tiny_model_dir, tmp_path_factory.mktemp("fi_head"),
                                            trained=True)
    return path


class TestInterpretedEngine(EngineTest):
    @pytest.fixture(autouse=True)
    def _cpu_entry(self, monkeypatch: pytest.MonkeyPatch) -> None:
        entry = load_plugins((), allowlist=EngineConfig().plugins).registries.attention.get(NAME)
        caps = dataclasses.replace(entry.capabilities, devices=frozenset({"cpu"}),
                                   dtypes=frozenset({"float32"}))
        monkeypatch.setattr(entry, "capabilities", caps)
        monkeypatch.setattr(entry, "load", lambda: _Interpreted)

    def _generate(self, model: Path, **overrides: Any) -> list[list[int]]:
        with self.engine(model=str(model), dtype="float32", **overrides) as engine:
            if overrides.get("attention") == NAME:
                assert isinstance(engine.backend, FlashInferAttentionBackend)
            out = engine.generate(PROMPTS, GREEDY)
            self.assert_idle_memory_whole(engine)
        return [r.token_ids for r in out]

    @pytest.mark.parametrize("page_size", [1, 16])
    def test_greedy_matches_torch_native(self, tiny_model_dir: Path, page_size: int) -> None:
        options = {"page_size": page_size, "chunked_prefill_size": 16}
        want = self._generate(tiny_model_dir, attention="torch_native", **options)
        assert self._generate(tiny_model_dir, attention=NAME, **options) == want

    @pytest.mark.parametrize(("page_size", "overlap"), [(16, False), (4, True)])
    def test_eagle_tree_on_pages_is_lossless(
        self, tiny_model_dir: Path, trained_head: Path, page_size: int, overlap: bool
    ) -> None:
        want = self._generate(tiny_model_dir, attention="torch_native", page_size=page_size)
        got = self._generate(tiny_model_dir, attention=NAME, page_size=page_size, spec="eagle",
                             draft_model=str(trained_head), spec_steps=3, spec_topk=4,
                             spec_draft_tokens=8, overlap=overlap)
        assert got == want
