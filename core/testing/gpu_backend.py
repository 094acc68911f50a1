"""Shared tests of a paged attention backend with pluggable kernels (fa3, flashinfer, yours).

A backend class built as `cls(ctx, kernels=...)`, whose `kernels` default to the real CUDA
library and can be replaced by a CPU interpreter module (`reference`), is tested in four ways.
A plugin subclasses each base in its own test module and names the backend; pytest collects
the subclasses there (the bases' names do not start with `Test`):

    class TestFA3Kernels(CudaKernelCases):
        backend_cls = FA3AttentionBackend
        reference = reference

    class TestFA3Conformance(InterpretedKernelCases):
        backend_cls = FA3AttentionBackend
        reference = reference

    class TestFA3Engine(CudaEngineCases):
        attention = "fa3"

    class TestInterpretedEngine(InterpretedEngineCases):
        attention = "fa3"
        backend_cls = FA3AttentionBackend
        reference = reference

- `InterpretedKernelCases` (CPU): the backend with the interpreter as its kernels against
  torch_native on random paged caches (its docstring lists the cases).
- `CudaKernelCases` (marked `gpu`): the real kernels and the interpreter against torch_native
  run in fp32, model-sized heads (head_dim 128, GQA 4), bf16 and fp16; needs the plugin's
  `gpu_cases` fixture (a CUDA `plugserve.testing.paged_cases.Cases`).
- `CudaEngineCases` (marked `gpu`): a tiny random Llama (head_dim 64) in fp16 through the whole
  engine with the checker on: greedy output equals torch_native's, EAGLE tree drafting on
  16-token pages (topk 4, the holey layout) equals plain greedy decoding.
- `InterpretedEngineCases` (CPU): the whole engine with the registry entry patched to allow the
  CPU and float32 and to build the backend with `kernels=reference`; greedy output equals
  torch_native's and EAGLE tree drafting (pages of 16, and of 4 under the overlap loop) equals
  torch_native's greedy decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from plugserve.attention.base import AttentionBackend, AttentionContext
from plugserve.config import EngineConfig
from plugserve.plugins import load_plugins
from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardBatch
from plugserve.testing.engine_test import EngineTest
from plugserve.testing.paged_cases import (
    TOLERANCE,
    Cases,
    Shape,
    max_error,
    native,
    native_tree_window,
    run_backend,
)
from plugserve.testing.tiny_models import make_tiny_model_dir

__all__ = ["PROMPTS", "CudaEngineCases", "CudaKernelCases", "InterpretedEngineCases",
           "InterpretedKernelCases", "cases", "gpu_cases", "greedy", "skip_gpu_tests_unless"]

Oracle = Callable[[ForwardBatch, torch.Tensor, Shape], torch.Tensor]

# Three prompts of 5, 23 and 40 tokens, and a fourth that shares a cached prefix with the third.
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 23, 40])]
PROMPTS.append([*PROMPTS[2][:30], 9, 8, 7])

DTYPES = [torch.bfloat16, torch.float16]


def skip_gpu_tests_unless(available: bool, items: list[pytest.Item], *, plugin_dir: str,
                          reason: str) -> None:
    """For a plugin's `pytest_collection_modifyitems`: skip its `gpu`-marked tests (those
    under a path containing `plugin_dir`) with `reason` unless the kernels are `available`."""
    if available:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords and plugin_dir in str(item.path):
            item.add_marker(skip)


@pytest.fixture
def cases(request: pytest.FixtureRequest) -> Cases:
    """Seeded per test, on the CPU (import it into the plugin's conftest)."""
    return Cases(torch.device("cpu"), sum(map(ord, request.node.name)) % 10_000)


@pytest.fixture
def gpu_cases(request: pytest.FixtureRequest) -> Cases:
    """Seeded per test, on CUDA (import it into the plugin's conftest)."""
    return Cases(torch.device("cuda"), sum(map(ord, request.node.name)) % 10_000)


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def _model_shape(page_size: int, dtype: torch.dtype, window: int | None = None) -> Shape:
    return Shape(page_size, num_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype,
                 sliding_window=window)


class InterpretedKernelCases:
    """The backend with `reference` as its kernels against torch_native on the CPU.

    Each case builds the metadata exactly as on CUDA and makes the same kernel calls; random
    paged caches with shuffled pages: extend with cached prefixes, mixed lengths, sliding
    windows, tree verify (a tree's window counts token positions), decode, and topk>1 draft
    decode in the holey layout at page sizes 1, 4 and 16. Needs the plugin's `cases` fixture
    (a CPU `plugserve.testing.paged_cases.Cases`)."""

    backend_cls: ClassVar[type[AttentionBackend]]
    reference: ClassVar[ModuleType]

    def _check(self, cases: Cases, shape: Shape, fb: ForwardBatch, *, spec_topk: int = 1,
               oracle: Oracle = native) -> None:
        build: Any = self.backend_cls
        backend = build(shape.context(cases.device, spec_topk=spec_topk),
                        kernels=self.reference)
        q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        got = run_backend(backend, fb, q, shape)
        want = oracle(fb, q, shape)
        assert got.dtype == shape.dtype
        assert max_error(got, want) <= TOLERANCE[shape.dtype]

    @pytest.mark.parametrize("page_size", [1, 4, 16])
    @pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
    def test_extend_with_cached_prefixes(self, cases: Cases, page_size: int,
                                         heads: tuple[int, int]) -> None:
        shape = Shape(page_size, num_heads=heads[0], num_kv_heads=heads[1])
        fb = cases.extend(shape, prefix_lens=[0, 5, 16, 33], extend_lens=[7, 1, 12, 3])
        self._check(cases, shape, fb)

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_extend_sliding_window(self, cases: Cases, page_size: int) -> None:
        shape = Shape(page_size, sliding_window=6)
        fb = cases.extend(shape, prefix_lens=[0, 9, 21], extend_lens=[11, 4, 2])
        self._check(cases, shape, fb)

    @pytest.mark.parametrize("page_size", [1, 4, 16])
    def test_tree_verify_mask(self, cases: Cases, page_size: int) -> None:
        shape = Shape(page_size)
        fb = cases.extend(shape, prefix_lens=[3, 17, 30], extend_lens=[6, 8, 5], tree_mask=True)
        self._check(cases, shape, fb)

    @pytest.mark.parametrize("page_size", [1, 4])
    @pytest.mark.parametrize("window", [3, 12])
    def test_tree_verify_window_counts_positions(self, cases: Cases, page_size: int,
                                                 window: int) -> None:
        """A node at depth d sits at prefix + d whatever its row: the window counts positions
        (windows narrower than the draft included)."""
        shape = Shape(page_size, sliding_window=window)
        fb = cases.extend(shape, prefix_lens=[3, 17, 30], extend_lens=[6, 8, 5], tree_mask=True)
        self._check(cases, shape, fb, oracle=native_tree_window)

    @pytest.mark.parametrize("window", [3, 12])
    def test_chain_verify_window(self, cases: Cases, window: int) -> None:
        """For a chain, positions and rows agree: torch_native's own window is the oracle."""
        shape = Shape(4, sliding_window=window)
        fb = cases.extend(shape, prefix_lens=[3, 17], extend_lens=[6, 8], tree_mask=True,
                          chain=True)
        self._check(cases, shape, fb)

    @pytest.mark.parametrize("page_size", [1, 4, 16])
    @pytest.mark.parametrize("window", [None, 5])
    def test_decode_mixed_lengths(self, cases: Cases, page_size: int,
                                  window: int | None) -> None:
        shape = Shape(page_size, sliding_window=window)
        fb = cases.decode(shape, seq_lens=[1, 4, 5, 16, 17, 40])
        self._check(cases, shape, fb)

    @pytest.mark.parametrize("page_size", [1, 4, 16])
    @pytest.mark.parametrize("topk", [2, 4])
    @pytest.mark.parametrize("lists", ["core", "lanes"])
    def test_topk_draft_decode_holey_layout(self, cases: Cases, page_size: int, topk: int,
                                            lists: str) -> None:
        shape = Shape(page_size)
        for step in (0, 2):
            fb = cases.draft_decode(shape, prefix_lens=[3, 8, 14], topk=topk, step=step,
                                    num_steps=3, lists=lists)
            self._check(cases, shape, fb, spec_topk=topk)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision(self, cases: Cases, dtype: torch.dtype) -> None:
        shape = Shape(4, dtype=dtype)
        self._check(cases, shape, cases.extend(shape, prefix_lens=[4, 10], extend_lens=[3, 6],
                                               tree_mask=True))
        self._check(cases, shape, cases.decode(shape, seq_lens=[3, 19]))


class CudaKernelCases:
    """The real kernels, and the interpreter beside them, against torch_native on CUDA."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.gpu]
    backend_cls: ClassVar[type[AttentionBackend]]
    reference: ClassVar[ModuleType]

    def _compare(self, cases: Cases, shape: Shape, fb: ForwardBatch, *, spec_topk: int = 1,
                 oracle: Oracle = native) -> None:
        ctx = shape.context(cases.device, spec_topk=spec_topk, max_batch_size=16)
        q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim, dtype=shape.dtype)
        build: Any = self.backend_cls
        got = run_backend(build(ctx), fb, q, shape)
        want = oracle(fb, q, shape)
        assert max_error(got, want) <= TOLERANCE[shape.dtype]
        interpreted = run_backend(build(ctx, kernels=self.reference), fb, q, shape)
        assert max_error(interpreted, want) <= TOLERANCE[shape.dtype]

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("window", [None, 64])
    def test_extend_on_cuda(self, gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                            window: int | None) -> None:
        shape = _model_shape(page_size, dtype, window)
        self._compare(gpu_cases, shape, gpu_cases.extend(shape, [0, 37, 300], [129, 1, 200]))

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("window", [None, 64])
    def test_tree_verify_on_cuda(self, gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                                 window: int | None) -> None:
        shape = _model_shape(page_size, dtype, window)
        fb = gpu_cases.extend(shape, [90, 513], [8, 16], tree_mask=True)
        self._compare(gpu_cases, shape, fb,
                      oracle=native if window is None else native_tree_window)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("window", [None, 100])
    def test_decode_on_cuda(self, gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                            window: int | None) -> None:
        shape = _model_shape(page_size, dtype, window)
        self._compare(gpu_cases, shape, gpu_cases.decode(shape, [1, 77, 1000, 4097]))

    @pytest.mark.parametrize("topk", [2, 4])
    @pytest.mark.parametrize("page_size", [1, 16])
    @pytest.mark.parametrize("lists", ["core", "lanes"])
    def test_topk_draft_decode_on_cuda(self, gpu_cases: Cases, topk: int, page_size: int,
                                       lists: str) -> None:
        shape = _model_shape(page_size, torch.bfloat16)
        fb = gpu_cases.draft_decode(shape, [5, 300, 1030], topk=topk, step=2, num_steps=4,
                                    lists=lists)
        self._compare(gpu_cases, shape, fb, spec_topk=topk)


class CudaEngineCases(EngineTest):
    """The whole engine on CUDA in fp16 with the backend named `attention`."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.gpu]
    env: ClassVar[dict[str, str]] = {"PLUGSERVE_DEVICE": "cuda", "PLUGSERVE_DTYPE": "float16"}
    attention: ClassVar[str]

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """A tiny Llama with head_dim 64 (the kernels need a supported head size)."""
        return make_tiny_model_dir(tmp_path_factory.mktemp(f"{cls.attention}_llama"),
                                   arch="llama", seed=0, hidden_size=256,
                                   num_attention_heads=4, num_key_value_heads=2)

    def _generate(self, model: Path, **overrides: object) -> list[list[int]]:
        with self.engine(model=str(model), **overrides) as engine:
            out = engine.generate(PROMPTS, greedy(12))
            self.assert_idle_memory_whole(engine)
        return [r.token_ids for r in out]

    @pytest.mark.parametrize("page_size", [1, 16])
    def test_greedy_matches_torch_native(self, model_dir: Path, page_size: int) -> None:
        options = {"page_size": page_size, "chunked_prefill_size": 16}
        want = self._generate(model_dir, attention="torch_native", **options)
        assert self._generate(model_dir, attention=self.attention, **options) == want

    def test_eagle_tree_on_pages_is_lossless(self, model_dir: Path, tmp_path: Path) -> None:
        testing = pytest.importorskip("plugserve_spec_eagle.testing")
        head = testing.make_tiny_head_dir(model_dir, tmp_path / "head", trained=False)
        plain = self._generate(model_dir, attention=self.attention, page_size=16)
        spec = self._generate(model_dir, attention=self.attention, page_size=16, spec="eagle",
                              draft_model=str(head), spec_steps=3, spec_topk=4,
                              spec_draft_tokens=8)
        assert spec == plain


class InterpretedEngineCases(EngineTest):
    """The whole engine on the CPU with the backend's kernels replaced by `reference`."""

    attention: ClassVar[str]
    backend_cls: ClassVar[type[AttentionBackend]]
    reference: ClassVar[ModuleType]

    @pytest.fixture(autouse=True)
    def _cpu_entry(self, monkeypatch: pytest.MonkeyPatch) -> None:
        entry = load_plugins((), allowlist=EngineConfig().plugins).registries.attention.get(
            self.attention)
        caps = dataclasses.replace(entry.capabilities, devices=frozenset({"cpu"}),
                                   dtypes=frozenset({"float32"}))
        build: Any = self.backend_cls
        kernels = self.reference

        class Interpreted(build):
            """The backend as the engine builds it (`cls(ctx)`), with the interpreter."""

            def __init__(self, ctx: AttentionContext) -> None:
                super().__init__(ctx, kernels=kernels)

        monkeypatch.setattr(entry, "capabilities", caps)
        monkeypatch.setattr(entry, "load", lambda: Interpreted)

    @pytest.fixture(scope="class")
    @classmethod
    def trained_head(cls, tiny_model_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
        testing = pytest.importorskip("plugserve_spec_eagle.testing")
        path: Path = testing.make_tiny_head_dir(
            tiny_model_dir, tmp_path_factory.mktemp(f"{cls.attention}_head"), trained=True)
        return path

    def _generate(self, model: Path, **overrides: Any) -> list[list[int]]:
        with self.engine(model=str(model), dtype="float32", **overrides) as engine:
            if overrides.get("attention") == self.attention:
                assert isinstance(engine.backend, self.backend_cls)
            out = engine.generate(PROMPTS, greedy(12))
            self.assert_idle_memory_whole(engine)
        return [r.token_ids for r in out]

    @pytest.mark.parametrize("page_size", [1, 16])
    def test_greedy_matches_torch_native(self, tiny_model_dir: Path, page_size: int) -> None:
        options = {"page_size": page_size, "chunked_prefill_size": 16}
        want = self._generate(tiny_model_dir, attention="torch_native", **options)
        assert self._generate(tiny_model_dir, attention=self.attention, **options) == want

    @pytest.mark.parametrize(("page_size", "overlap"), [(16, False), (4, True)])
    def test_eagle_tree_on_pages_is_lossless(
        self, tiny_model_dir: Path, trained_head: Path, page_size: int, overlap: bool
    ) -> None:
        want = self._generate(tiny_model_dir, attention="torch_native", page_size=page_size)
        got = self._generate(tiny_model_dir, attention=self.attention, page_size=page_size,
                             spec="eagle", draft_model=str(trained_head), spec_steps=3,
                             spec_topk=4, spec_draft_tokens=8, overlap=overlap)
        assert got == want
