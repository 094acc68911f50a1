"""plugserve attention backend `flashinfer`: FlashInfer's paged-KV wrappers on CUDA.

Importing this package is cheap: flashinfer is imported only when the backend is built for
CUDA. Modules:

- `plugin`: the hooks registering the backend "flashinfer" and its fix toggle.
- `capabilities`: what the backend supports, and `VERIFIED_ON` (the last GPU verification).
- `fixes`: the fix toggle names and how a backend learns which are reverted.
- `pages`: KV lists (request rows, per-branch draft lists) as FlashInfer page lists.
- `buffers`: the persistent kv_indices buffer, sized with the topk factor.
- `metadata`: per-batch plan arguments (plain torch), built once by `init_forward_metadata`.
- `tree_window`: a tree verify's sliding window folded into its mask (windows count positions).
- `reference`: a CPU interpreter of FlashInfer's wrappers, the oracle for the metadata.
- `backend`: `FlashInferAttentionBackend`, the `AttentionBackend` the engine drives.
"""

from __future__ import annotations

__version__ = "0.1.0"
