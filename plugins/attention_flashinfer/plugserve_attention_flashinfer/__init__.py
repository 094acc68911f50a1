"""plugserve attention backend `flashinfer`: FlashInfer's paged-KV kernels on CUDA."""

from __future__ import annotations
