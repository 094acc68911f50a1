"""The whole engine on CPU with this backend, its kernels replaced by the CPU interpreter.

Only the kernels differ from a CUDA run: the engine builds the backend through its registry
entry, the scheduler, prefix cache, chunked prefill, paged memory (checker on) and EAGLE's
tree drafting drive `init_forward_metadata` and the wrappers exactly as on a GPU. The entry
is patched for the test to allow the CPU and float32 and to build the backend with
`kernels=reference`. Greedy output equals torch_native's; EAGLE tree drafting (topk 4, the
holey layout on pages of 16 and of 4 under the overlap loop) equals plain greedy decoding.
"""

from __future__ import annotations

from plugserve.testing.gpu_backend import InterpretedEngineCases
from plugserve_attention_flashinfer import reference
from plugserve_attention_flashinfer.backend import FlashInferAttentionBackend


class TestInterpretedEngine(InterpretedEngineCases):
    attention = "flashinfer"
    backend_cls = FlashInferAttentionBackend
    reference = reference
