"""plugserve attention backend `fa3`: FlashAttention 3's paged `flash_attn_with_kvcache`.

Importing this package is cheap: FA3 is imported only when the backend is built for CUDA.
Modules:

- `plugin`: the hooks registering the backend "fa3" and its fix toggle.
- `capabilities`: what the backend supports, and `VERIFIED_ON` (the last GPU verification).
- `fixes`: the fix toggle name.
- `environment`: whether an FA3 build can load here (torch symbols checked with `nm -D`),
  without importing it.
- `pages`: the reverted branch fill of the fix toggle (page lists come from
  `plugserve.attention.paging`).
- `page_table`: the persistent page-table buffer and its scatter.
- `metadata`: per-batch call arguments (plain torch), built once by `init_forward_metadata`.
- `merge`: merging two partial attentions by their log-sum-exps (tree verify).
- `reference`: a CPU interpreter of `flash_attn_with_kvcache`, the oracle for the metadata.
- `backend`: `FA3AttentionBackend`, the `AttentionBackend` the engine drives.
"""

from __future__ import annotations

__version__ = "0.1.0"
