"""Fixtures for the Triton backend's tests: hand-built paged caches and ForwardBatches.

The shuffled-page harness itself lives in the conformance suite
(`plugserve.testing.conformance.paged`); this file adds the Triton/torch_native pair.

Without CUDA the kernels run in Triton's CPU interpreter, which must be switched on before
the kernel modules are imported; we do it here, first thing. With CUDA (and no explicit
TRITON_INTERPRET) the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_PLUGIN_ROOT = Path(__file__).resolve().parents[1]
if str(_PLUGIN_ROOT) not in sys.path:  # run from a checkout without installing the plugin
    sys.path.insert(0, str(_PLUGIN_ROOT))

import pytest  # noqa: E402

from plugserve.attention.base import AttentionLayer  # noqa: E402
from plugserve.attention.torch_native import TorchNativeBackend  # noqa: E402
from plugserve.structs.forward_batch import ForwardBatch  # noqa: E402
from plugserve.testing.conformance.paged import BatchFactory, fp32_twin  # noqa: E402
from plugserve_attention_triton.backend import TritonAttentionBackend  # noqa: E402
from plugserve_attention_triton.runtime import interpreter_requested  # noqa: E402

INTERPRETED = interpreter_requested()
KERNEL_DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    compiled_gpu = torch.cuda.is_available() and not INTERPRETED
    skip = pytest.mark.skip(reason="needs CUDA with compiled Triton kernels (TRITON_INTERPRET off)")
    for item in items:
        if "gpu" in item.keywords and not compiled_gpu and "attention_triton" in str(item.path):
            item.add_marker(skip)


class TritonBatchFactory(BatchFactory):
    """The conformance suite's shuffled-page harness, plus the two backends these tests
    compare."""

    def backends(
        self, layer: AttentionLayer, page_size: int, dtype: torch.dtype, **triton_kwargs: int
    ) -> tuple[TritonAttentionBackend, TorchNativeBackend]:
        ctx = self.context(layer, page_size, dtype)
        return TritonAttentionBackend(ctx, **triton_kwargs), TorchNativeBackend(ctx)


def run_both(
    fb: ForwardBatch, q: torch.Tensor, layer: AttentionLayer,
    triton_backend: TritonAttentionBackend, native: TorchNativeBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch_native output) of the same batch; metadata built by each.

    torch_native runs in fp32 on an fp32 copy of the cache, so half-precision runs are
    compared with the exact answer rather than with another rounded one.
    """
    triton_backend.init_forward_metadata(fb)
    if fb.mode.is_decode():
        got = triton_backend.forward_decode(q, layer, fb)
    else:
        got = triton_backend.forward_extend(q, layer, fb)
    twin = fp32_twin(fb)
    native.init_forward_metadata(twin)
    if fb.mode.is_decode():
        want = native.forward_decode(q.float(), layer, twin)
    else:
        want = native.forward_extend(q.float(), layer, twin)
    return got, want


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error against an fp32 oracle: fp32 exact to 1e-5; half types about 1 ulp."""
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.fixture
def kernel_device() -> torch.device:
    """Where the kernels run in this process: cuda when compiled, else cpu (interpreter)."""
    return KERNEL_DEVICE


@pytest.fixture
def factory(request: pytest.FixtureRequest) -> Iterator[TritonBatchFactory]:
    seed = sum(map(ord, request.node.name)) % 10_000
    yield TritonBatchFactory(device=KERNEL_DEVICE, seed=seed)


@pytest.fixture
def gpu_factory(request: pytest.FixtureRequest) -> Iterator[TritonBatchFactory]:
    seed = sum(map(ord, request.node.name)) % 10_000
    yield TritonBatchFactory(device=torch.device("cuda"), seed=seed)


@pytest.fixture
def compare() -> object:
    """`compare(fb, q, layer, triton_backend, native)` -> (triton output, reference output)."""
    return run_both


@pytest.fixture
def upcast() -> object:
    """`upcast(fb)`: the batch over an fp32 copy of its KV pool."""
    return fp32_twin


@pytest.fixture
def tol() -> object:
    """`tol(dtype)`: the max abs error allowed against the reference."""
    return tolerance
