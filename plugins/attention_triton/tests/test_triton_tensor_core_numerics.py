"""The tensor-core numerics in Triton's CPU interpreter, against the float64 oracle at the
conformance suite's tolerances.

The kernels multiply bf16/fp16 operands with fp32 accumulation and round the softmax
probabilities to the input dtype before P.V, as on the GPU. Each case runs twice: with the
interpreter's own tiles and with the exact tiles and launch the CUDA launcher builds (sm_90;
the CUDA tile table is the same for sm_80), so block edges, partial tiles and masks are
exercised at the GPU's tile shapes too. Head sizes 64/128/256, all three dtypes, a prefill
over a cached prefix, a tree-mask verify with a sliding window, and a split decode with a
window.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugserve.attention.base import AttentionLayer
from plugserve.attention.paging import decode_slot_lists
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.testing.conformance.kernel_checks import check_output
from plugserve.testing.conformance.paged import BatchFactory
from plugserve.testing.conformance.reference import TOLERANCES, reference_attention
from plugserve_attention_triton.kernels.tiles import dot_in_fp32
from plugserve_attention_triton.metadata import (
    TritonAttnMetadata,
    build_decode_metadata,
    build_extend_metadata,
)
from plugserve_attention_triton.runtime import interpreter_requested, prepare_triton_runtime

if not interpreter_requested():  # with CUDA the kernels are compiled: test_triton_gpu.py
    pytest.skip("checks the kernels in the CPU interpreter (TRITON_INTERPRET=1)",
                allow_module_level=True)
kernels = prepare_triton_runtime("cpu")

NUM_HEADS, NUM_KV_HEADS = 4, 2
CUDA_ARCH = 90
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _launches(fb: ForwardBatch, q: torch.Tensor, layer: AttentionLayer, meta: TritonAttnMetadata,
              arch: int | None, *, dot_fp32: bool | None = None) -> torch.Tensor:
    """Run the launches the launcher builds for `arch` here, in the interpreter. With a CUDA
    arch the bf16 operands still go to fp32 for the dot (the interpreter cannot multiply bf16,
    see `tiles.dot_in_fp32`), after the same roundings as on the GPU."""
    k_buffer = fb.kv_pool.get_k(layer.layer_id)
    v_buffer = fb.kv_pool.get_v(layer.layer_id)
    out = torch.empty_like(q)
    common = dict(scaling=layer.scaling, sliding_window=layer.sliding_window, arch=arch)
    if meta.is_decode:
        launches = list(kernels.decode_launches(q, k_buffer, v_buffer, out, meta, **common))
    else:
        launches = [kernels.extend_launch(q, k_buffer, v_buffer, out, meta, **common)]
    wanted = dot_in_fp32(None, q.dtype) if dot_fp32 is None else dot_fp32
    for launch in launches:
        if "DOT_IN_FP32" in launch.options:
            launch = dataclasses.replace(launch, options={**launch.options,
                                                          "DOT_IN_FP32": wanted})
        launch.run()
    return out


def _case(name: str, factory: BatchFactory, dtype: torch.dtype, head_dim: int
          ) -> tuple[ForwardBatch, AttentionLayer, TritonAttnMetadata]:
    shape = dict(page_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=dtype)
    window = None
    if name == "prefill":
        fb = factory.extend_batch(prefix_lens=[0, 45], extend_lens=[70, 9], **shape)
        meta = build_extend_metadata(fb)
    elif name == "tree_window":
        fb = factory.extend_batch(prefix_lens=[90, 20], extend_lens=[9, 6], tree_mask=True,
                                  mode=ForwardMode.TARGET_VERIFY, **shape)
        meta, window = build_extend_metadata(fb), 40
    else:
        fb = factory.decode_batch(seq_lens=[5, 600, 130], **shape)
        kv_indptr_cpu, kv_indices = decode_slot_lists(fb)
        meta = build_decode_metadata(kv_indptr_cpu=kv_indptr_cpu, kv_indices=kv_indices,
                                     max_kv_splits=4, min_tokens_per_split=128)
        window = 300
        assert meta.max_kv_splits == 4
    layer = factory.layer(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                          sliding_window=window)
    return fb, layer, meta


@pytest.mark.parametrize("tiles", ["interpreter", "cuda"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", ["prefill", "tree_window", "split_decode_window"])
def test_within_suite_tolerance_of_float64(name, dtype, head_dim, tiles):
    factory = BatchFactory(device="cpu", seed=head_dim + len(name))
    fb, layer, meta = _case(name, factory, dtype, head_dim)
    q = factory.randn(fb.num_tokens, NUM_HEADS, head_dim, dtype=dtype)
    got = _launches(fb, q, layer, meta, None if tiles == "interpreter" else CUDA_ARCH)
    pool = fb.kv_pool
    want = reference_attention(fb, q, layer, pool.get_k(layer.layer_id),
                               pool.get_v(layer.layer_id))
    check_output(got, q, want, TOLERANCES[dtype], fb, f"{name} {dtype} d{head_dim} {tiles}")


def test_bf16_dot_needs_fp32_operands_in_the_interpreter():
    """Triton's interpreter multiplies bf16 dot operands as raw 16-bit integers
    (triton-lang/triton#11584): without the kernels' fp32 operands the output is garbage.
    When a Triton release fixes it, this fails: `dot_in_fp32` can then return False."""
    factory = BatchFactory(device="cpu", seed=7)
    fb, layer, meta = _case("prefill", factory, torch.bfloat16, 64)
    q = factory.randn(fb.num_tokens, NUM_HEADS, 64, dtype=torch.bfloat16)
    want = reference_attention(fb, q, layer, fb.kv_pool.get_k(layer.layer_id),
                               fb.kv_pool.get_v(layer.layer_id))
    raw = _launches(fb, q, layer, meta, None, dot_fp32=False)
    with pytest.raises(AssertionError, match=r"vs the float64 reference|non-finite"):
        check_output(raw, q, want, TOLERANCES[torch.bfloat16], fb, "bf16 dot without fp32")
    fixed = _launches(fb, q, layer, meta, None, dot_fp32=True)
    check_output(fixed, q, want, TOLERANCES[torch.bfloat16], fb, "bf16 dot in fp32")
