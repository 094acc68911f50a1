"""The backend, with FA3's CPU interpreter as its kernel, equals torch_native.

Every case builds the metadata exactly as on CUDA and makes the same `flash_attn_with_kvcache`
calls; only the kernel is the interpreter of `reference.py`. Random paged caches with
shuffled pages: extend with cached prefixes, mixed lengths, sliding windows, tree verify
(prefix by pages + tree tokens by slots, merged by LSE; on a windowed layer one call by slots,
the window counting token positions), decode, and topk>1 draft decode in the holey layout at
page sizes 1, 4 and 16.
"""

from __future__ import annotations

from plugserve.testing.gpu_backend import InterpretedKernelCases
from plugserve.testing.paged_cases import Cases, Shape
from plugserve_attention_fa3 import reference
from plugserve_attention_fa3.backend import FA3AttentionBackend


class TestFA3Conformance(InterpretedKernelCases):
    backend_cls = FA3AttentionBackend
    reference = reference

    def test_tree_verify_without_a_cached_prefix(self, cases: Cases) -> None:
        """A request with no prefix: its prefix part reads nothing and must not count."""
        shape = Shape(4)
        fb = cases.extend(shape, prefix_lens=[0, 7], extend_lens=[5, 4], tree_mask=True)
        self._check(cases, shape, fb)
