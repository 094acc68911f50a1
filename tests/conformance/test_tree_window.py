"""A bug the conformance suite found, pinned without the suite's own oracle.

Tree verify on a sliding-window layer must give each draft node exactly what plain decoding
of its path would: a node at depth d (index j >= d among the new tokens) sees the keys whose
positions are > prefix + d - window. torch_native and triton once measured the window from
prefix + j, so a node after the first branch missed prefix keys it should see and
speculative decoding on a sliding-window model was not lossless.
"""

from __future__ import annotations

import pytest
import torch

from plugserve.attention.base import AttentionBackend
from plugserve.attention.torch_native import TorchNativeBackend
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.testing.conformance.paged import BatchFactory

PREFIX, NODES, WINDOW, HEADS, DIM = 20, 6, 3, 2, 16


def _verify_and_path_decodes(backend_class: type[AttentionBackend]) -> tuple[
        torch.Tensor, torch.Tensor, list[int]]:
    """(verify output per node, plain decode of each node's path, node depths)."""
    factory = BatchFactory(device="cpu", seed=7)
    fb = factory.extend_batch(prefix_lens=[PREFIX], extend_lens=[NODES], page_size=4,
                              num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32,
                              tree_mask=True, mode=ForwardMode.TARGET_VERIFY)
    layer = factory.layer(num_heads=HEADS, num_kv_heads=HEADS, head_dim=DIM,
                          sliding_window=WINDOW)
    backend = backend_class(factory.context(layer, 4, torch.float32))
    q = factory.randn(NODES, HEADS, DIM, dtype=torch.float32)
    k = factory.randn(NODES, HEADS, DIM, dtype=torch.float32)
    v = factory.randn(NODES, HEADS, DIM, dtype=torch.float32)
    backend.init_forward_metadata(fb)
    verify = backend.forward(q, k, v, layer, fb)  # stores the nodes' K/V too

    assert fb.custom_mask is not None
    mask = fb.custom_mask.view(NODES, PREFIX + NODES)[:, PREFIX:]
    row = fb.req_to_token[int(fb.req_pool_indices[0])]
    depths = [int(mask[j].sum()) - 1 for j in range(NODES)]
    # One decode request per node: the prefix, then the node's ancestors and itself.
    table = torch.zeros(NODES, PREFIX + NODES, dtype=row.dtype)
    for j in range(NODES):
        path = torch.nonzero(mask[j]).flatten() + PREFIX
        table[j, : PREFIX + len(path)] = torch.cat([row[:PREFIX], row[path]])
    lens = [PREFIX + d + 1 for d in depths]
    decode = ForwardBatch.from_lengths(
        ForwardMode.DECODE, input_ids=[0] * NODES, positions=[n - 1 for n in lens],
        out_cache_loc=[0] * NODES, req_pool_indices=torch.arange(NODES),
        prefix_lens=[n - 1 for n in lens], extend_lens=[1] * NODES, req_to_token=table,
        kv_pool=fb.kv_pool, device="cpu")
    backend.init_forward_metadata(decode)
    return verify, backend.forward_decode(q, layer, decode), depths


def _triton_backend() -> type[AttentionBackend]:
    from plugserve_attention_triton.backend import TritonAttentionBackend

    return TritonAttentionBackend


def _example_backend() -> type[AttentionBackend]:
    from plugserve_attention_example.backend import ExampleBackend

    return ExampleBackend


@pytest.mark.parametrize("backend", [
    pytest.param(lambda: TorchNativeBackend, id="torch_native"),
    pytest.param(_triton_backend, id="triton", marks=pytest.mark.integration),
    pytest.param(_example_backend, id="example"),
])
def test_tree_verify_window_matches_decoding_each_path(backend: object) -> None:
    verify, decoded, depths = _verify_and_path_decodes(backend())  # type: ignore[operator]
    assert any(d < j for j, d in enumerate(depths)), "the tree must branch for this test"
    worst = (verify - decoded).abs().amax(dim=(1, 2))
    assert torch.allclose(verify, decoded, atol=1e-5), (
        f"per-node max error {worst.tolist()} (node depths {depths})")
