"""The backend, with FlashInfer's CPU interpreter as its kernels, equals torch_native.

Every case builds the metadata exactly as on CUDA, plans the wrappers and runs them; only the
kernels are the interpreter of `reference.py`. Random paged caches with shuffled pages:
extend with cached prefixes, mixed lengths, sliding windows, tree-verify masks (a tree's
window counts token positions), decode, and topk>1 draft decode in the
holey layout at page sizes 1, 4 and 16.
"""

from __future__ import annotations

from plugserve.testing.gpu_backend import InterpretedKernelCases
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend


class TestFlashInferConformance(InterpretedKernelCases):
    backend_cls = FlashInferAttentionBackend
    reference = reference
