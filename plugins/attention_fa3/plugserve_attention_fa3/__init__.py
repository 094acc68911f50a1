"""plugserve attention backend `fa3`: FlashAttention 3 kernels on CUDA."""

from __future__ import annotations
