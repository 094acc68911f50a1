"""The plugin module the entry point names: registers the "example" backend.

Light on purpose: the backend module (and anything heavy it needs) is imported by the
loader, only when `--attention example` is selected.
"""

from __future__ import annotations

from typing import Any

from plugserve.attention.base import BackendCapabilities
from plugserve.hookspecs import hookimpl

BACKEND_NAME = "example"

# Every capability here is a promise the conformance suite holds the backend to: a declared
# dtype, page size or feature runs its tests, and they must pass.
CAPABILITIES = BackendCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    page_sizes=None,  # reads slots through req_to_token, so any page size and page order
    custom_mask=True,  # tree-mask verify: speculative decoding may run on it
    topk_gt1=True,  # per-branch draft KV lists (page_size 1; page>1 is the whitelist's call)
    sliding_window=True,
)


def load_backend() -> Any:
    from plugserve_attention_example.backend import ExampleBackend

    return ExampleBackend


@hookimpl
def plugserve_register_attention_backends(register: Any) -> None:
    register(BACKEND_NAME, load_backend, CAPABILITIES,
             description="worked example: plain PyTorch, one gather per request")
