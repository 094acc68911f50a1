"""FA3's real kernels on CUDA: kernel cases against torch_native, then whole engines.

Skipped without CUDA or without an FA3 build (see conftest). The cases are the shared ones of
`plugserve.testing.gpu_backend` (its docstring says what each checks): kernel cases with
model-sized heads in bf16 and fp16 against torch_native in fp32, the CPU interpreter
(`reference.py`) beside the real kernels, then a tiny Llama in fp16 through the whole engine
(greedy equals torch_native's; EAGLE tree drafting on 16-token pages is lossless).
"""

from __future__ import annotations

from plugserve.testing.gpu_backend import CudaEngineCases, CudaKernelCases
from plugserve_attention_fa3 import reference
from plugserve_attention_fa3.backend import FA3AttentionBackend


class TestFA3Kernels(CudaKernelCases):
    backend_cls = FA3AttentionBackend
    reference = reference


class TestFA3Engine(CudaEngineCases):
    attention = "fa3"
