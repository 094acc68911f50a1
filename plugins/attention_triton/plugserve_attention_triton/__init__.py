"""plugserve attention backend in Triton.

Importing this package is cheap: Triton itself is imported only when the backend is built
(see `runtime.prepare_triton_runtime`). Modules:

- `plugin`: the plugserve hook that registers the backend as "triton".
- `capabilities`: what the backend supports, as data.
- `runtime`: picks compiled CUDA kernels or the CPU interpreter before the kernels load.
- `metadata`: per-batch index tables (plain torch), built once by `init_forward_metadata`.
- `draft_kv`: per-branch KV lists for topk>1 draft decode (the spec-plugin contract).
- `reference`: plain-torch attention over the same tables, the oracle for the kernels.
- `kernels`: the Triton kernels (extend, split-KV decode and its reduction).
- `backend`: `TritonAttentionBackend`, the `AttentionBackend` the engine drives.
"""

from __future__ import annotations

__version__ = "0.1.0"
