"""plugserve attention backend `flashinfer`: FlashInfer's paged-KV wrappers on CUDA.

Importing this package is cheap: flashinfer is imported only when the backend is built for
CUDA. Modules:

- `plugin`: the hooks registering the backend "flashinfer" and its fix toggles.
- `capabilities`: what the backend supports, and `VERIFIED_ON` (the last GPU verification).
- `fixes`: the fix toggle names.
- `environment`: whether this machine can run FlashInfer (package, CUDA, a way to get its
  kernels), checked without importing it.
- `buffers`: the persistent kv_indices buffer, sized with the topk factor.
- `metadata`: per-batch plan arguments (plain torch), built once by `init_forward_metadata`;
  page lists, the decode dispatch and windows come from `plugserve.attention.paging`.
- `reference`: a CPU interpreter of FlashInfer's wrappers (and of its `auto` backend choice),
  the oracle for the metadata.
- `backend`: `FlashInferAttentionBackend`, the `AttentionBackend` the engine drives.
"""

from __future__ import annotations

__version__ = "0.1.0"
