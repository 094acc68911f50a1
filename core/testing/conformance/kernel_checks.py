"""Run one kernel case against the backend under test and check it against the oracle.

The backend is built from an `AttentionContext` as the engine builds it, gets
`init_forward_metadata` once, then `forward(q, k, v, layer, fb)` for each of two layers (the
engine-facing call: store the new K/V at `out_cache_loc`, then attend). Checked, per layer:

- the new K/V are in the pool at `out_cache_loc` as the pool's dtype stores them (a narrower
  KV cache dtype: rounded, fp8 saturated), and no other slot changed (page 0, the padding
  page, excepted);
- the output has q's shape, dtype and device, is finite, and is within the dtype's tolerance
  of the float64 oracle (`reference.TOLERANCES`); the oracle reads the same stored values, so
  a narrower cache is held to the queries' dtype's tolerance;
- `req_to_token` is unchanged.

Any mismatch raises `AssertionError` naming the scenario, the shape, the layer and where.
"""

from __future__ import annotations

import torch

from plugserve.attention.base import AttentionBackend, AttentionContext, AttentionLayer
from plugserve.pools.kv_pool import to_cache_dtype
from plugserve.structs.forward_batch import ForwardBatch
from plugserve.testing.conformance.paged import BatchFactory
from plugserve.testing.conformance.reference import (
    TOLERANCES,
    Tolerance,
    reference_attention,
    request_of_token,
)
from plugserve.testing.conformance.scenarios import DTYPES, KernelCase
from plugserve.testing.conformance.target import BackendUnderTest


def run_kernel_case(target: BackendUnderTest, case: KernelCase) -> None:
    """Build `case`, run the backend on it, and check every layer (see the module)."""
    run_kernel_case_with(target.backend_class, case, target.torch_device)


def run_kernel_case_with(
    backend_class: type[AttentionBackend], case: KernelCase, device: torch.device
) -> None:
    factory = BatchFactory(device=device, seed=case.seed)
    built = case.build(factory)
    fb = built.fb
    shape = case.shape
    dtype = DTYPES[shape.dtype]
    backend = backend_class(AttentionContext(
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        page_size=shape.page_size, max_batch_size=built.num_requests,
        context_len=int(fb.req_to_token.shape[1]), dtype=dtype, device=device,
        spec_topk=built.spec_topk,
    ))
    table = fb.req_to_token.clone()
    backend.init_forward_metadata(fb)
    for layer_id in fb.kv_pool.layer_ids:
        layer = factory.layer(num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                              head_dim=shape.head_dim, sliding_window=built.window,
                              layer_id=layer_id)
        where = f"{case.scenario.name}[{case.id}] layer {layer_id}"
        if built.window is not None:
            where += f" (sliding window {built.window})"
        _check_layer(backend, factory, fb, layer, dtype, where)
    assert torch.equal(fb.req_to_token, table), f"{case.scenario.name}[{case.id}]: the " \
        "backend changed req_to_token (it must only read it)"


def _check_layer(
    backend: AttentionBackend, factory: BatchFactory, fb: ForwardBatch, layer: AttentionLayer,
    dtype: torch.dtype, where: str,
) -> None:
    pool = fb.kv_pool
    n = fb.num_tokens
    q = factory.randn(n, layer.num_heads, layer.head_dim, dtype=dtype)
    k = factory.randn(n, layer.num_kv_heads, layer.head_dim, dtype=dtype)
    v = factory.randn(n, layer.num_kv_heads, layer.head_dim, dtype=dtype)
    k_want = pool.get_k(layer.layer_id).clone()
    v_want = pool.get_v(layer.layer_id).clone()
    k_want[fb.out_cache_loc] = to_cache_dtype(k, pool.dtype)
    v_want[fb.out_cache_loc] = to_cache_dtype(v, pool.dtype)
    q_before = q.clone()
    out = backend.forward(q, k, v, layer, fb)
    for label, got, want in (("K", pool.get_k(layer.layer_id), k_want),
                             ("V", pool.get_v(layer.layer_id), v_want)):
        _check_stored(label, got, want, fb, pool.page_size, where)
    assert torch.equal(q, q_before), f"{where}: the backend modified q in place"
    expected = reference_attention(fb, q, layer, k_want, v_want)
    check_output(out, q, expected, TOLERANCES[dtype], fb, where)


def _check_stored(label: str, got: torch.Tensor, want: torch.Tensor, fb: ForwardBatch,
                  page_size: int, where: str) -> None:
    if got.element_size() == 1:  # fp8: torch compares its bits only
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    new = fb.out_cache_loc
    if not torch.equal(got[new], want[new]):
        raise AssertionError(f"{where}: the new {label} is not stored at out_cache_loc (forward "
                             "must store k/v there before attending)")
    differs = (got != want).flatten(1).any(dim=1)
    differs[:page_size] = False  # page 0 takes padded or dummy writes
    if bool(differs.any()):
        slots = torch.nonzero(differs).flatten()[:5].tolist()
        raise AssertionError(f"{where}: the backend wrote {label} outside out_cache_loc "
                             f"(slots {slots})")


def check_output(out: torch.Tensor, q: torch.Tensor, expected: torch.Tensor, tol: Tolerance,
                 fb: ForwardBatch, where: str) -> None:
    """`out` has q's shape/dtype/device, is finite and within `tol` of the float64 oracle."""
    assert isinstance(out, torch.Tensor), f"{where}: forward returned {type(out).__name__}"
    assert tuple(out.shape) == tuple(q.shape), (
        f"{where}: output shape {tuple(out.shape)}, expected q's {tuple(q.shape)}")
    assert out.dtype == q.dtype, f"{where}: output dtype {out.dtype}, expected q's {q.dtype}"
    assert out.device == q.device, f"{where}: output on {out.device}, q on {q.device}"
    got = out.detach().cpu().double()
    finite = torch.isfinite(got)
    if not bool(finite.all()):
        token, head = (int(x) for x in torch.nonzero(~finite)[0][:2])
        raise AssertionError(
            f"{where}: {int((~finite).sum())} non-finite outputs; first at query row {token} "
            f"(batch entry {request_of_token(fb, token)}), head {head}")
    err = (got - expected).abs()
    excess = err - (tol.atol + tol.rtol * expected.abs())
    if bool((excess > 0).any()):
        flat = int(torch.argmax(excess))
        token, head = divmod(flat // got.shape[-1], got.shape[1])
        raise AssertionError(
            f"{where}: max abs error {float(err.max()):.3g} vs the float64 reference "
            f"(allowed {tol}); worst at query row {token} (batch entry "
            f"{request_of_token(fb, token)}), head {head}")
