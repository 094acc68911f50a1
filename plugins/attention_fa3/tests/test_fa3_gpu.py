"""FA3's real kernels on CUDA: kernel cases against torch_native, then whole engines.

Skipped without CUDA or without an FA3 build (see conftest). Kernel cases use
model-sized heads (head_dim 128, GQA 4) in bf16 and fp16 and compare with torch_native run in
fp32 over an fp32 copy of the same cache; the CPU interpreter (`reference.py`) must agree
with the real kernels too, which checks the interpreter itself. Engine tests run a tiny
random Llama (head_dim 64) in fp16 through the scheduler, prefix cache and paged memory with
the checker on: greedy output equals torch_native's, and EAGLE tree drafting on 16-token pages
(topk 4, the holey layout) is lossless against plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plugserve.sampling import SamplingParams
from plugserve.structs.forward_batch import ForwardBatch
from plugserve.testing import EngineTest
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
from plugserve_attention_fa3 import reference
from plugserve_attention_fa3.backend import FA3AttentionBackend

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def _compare(cases: Cases, shape: Shape, fb: ForwardBatch, *, spec_topk: int = 1,
             oracle: Callable[[ForwardBatch, torch.Tensor, Shape], torch.Tensor] = native) -> None:
    ctx = shape.context(cases.device, spec_topk=spec_topk, max_batch_size=16)
    q = cases.randn(fb.num_tokens, shape.num_heads, shape.head_dim,
                    dtype=shape.dtype)
    got = run_backend(FA3AttentionBackend(ctx), fb, q, shape)
    want = oracle(fb, q, shape)
    assert max_error(got, want) <= TOLERANCE[shape.dtype]
    interpreted = run_backend(FA3AttentionBackend(ctx, kernels=reference), fb, q, shape)
    assert max_error(interpreted, want) <= TOLERANCE[shape.dtype]


def _shape(page: int, dtype: torch.dtype, window: int | None = None) -> Shape:
    return Shape(page, num_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype,
                 sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 64])
def test_extend_on_cuda(gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                        window: int | None) -> None:
    shape = _shape(page_size, dtype, window)
    _compare(gpu_cases, shape, gpu_cases.extend(shape, [0, 37, 300], [129, 1, 200]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 64])
def test_tree_verify_on_cuda(gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                             window: int | None) -> None:
    shape = _shape(page_size, dtype, window)
    fb = gpu_cases.extend(shape, [90, 513], [8, 16], tree_mask=True)
    _compare(gpu_cases, shape, fb, oracle=native if window is None else native_tree_window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_on_cuda(gpu_cases: Cases, dtype: torch.dtype, page_size: int,
                        window: int | None) -> None:
    shape = _shape(page_size, dtype, window)
    _compare(gpu_cases, shape, gpu_cases.decode(shape, [1, 77, 1000, 4097]))


@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lists", ["core", "lanes"])
def test_topk_draft_decode_on_cuda(gpu_cases: Cases, topk: int, page_size: int,
                                   lists: str) -> None:
    shape = _shape(page_size, torch.bfloat16)
    fb = gpu_cases.draft_decode(shape, [5, 300, 1030], topk=topk, step=2, num_steps=4,
                                lists=lists)
    _compare(gpu_cases, shape, fb, spec_topk=topk)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head_dim 64 (FA3's kernels need a supported head size)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("fa3_llama"), arch="llama", seed=0,
                               hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 23, 40])]
PROMPTS.append([*PROMPTS[2][:30], 9, 8, 7])  # shares a cached prefix with prompt 2


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


class TestFA3Engine(EngineTest):
    env = {"PLUGSERVE_DEVICE": "cuda", "PLUGSERVE_DTYPE": "float16"}

    def _generate(self, model: Path, **overrides: object) -> list[list[int]]:
        with self.engine(model=str(model), **overrides) as engine:
            out = engine.generate(PROMPTS, _greedy(12))
            self.assert_idle_memory_whole(engine)
        return [r.token_ids for r in out]

    @pytest.mark.parametrize("page_size", [1, 16])
    def test_greedy_matches_torch_native(self, model_dir: Path, page_size: int) -> None:
        options = {"page_size": page_size, "chunked_prefill_size": 16}
        want = self._generate(model_dir, attention="torch_native", **options)
        assert self._generate(model_dir, attention="fa3", **options) == want

    def test_eagle_tree_on_pages_is_lossless(self, model_dir: Path, tmp_path: Path) -> None:
        testing = pytest.importorskip("plugserve_spec_eagle.testing")
        head = testing.make_tiny_head_dir(model_dir, tmp_path / "head", trained=False)
        plain = self._generate(model_dir, attention="fa3", page_size=16)
        spec = self._generate(model_dir, attention="fa3", page_size=16, spec="eagle",
                              draft_model=str(head), spec_steps=3, spec_topk=4,
                              spec_draft_tokens=8)
        assert spec == plain
