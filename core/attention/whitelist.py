"""The page>1+topk>1 whitelist: the attention backends that may run tree drafting (topk>1) on
a paged cache (page_size>1), because they can express the per-branch holey layout of
DESIGN.md §5.

It is the one place that decides; it is not a capability a backend declares. Keyed by the
distribution that registers the backend and the backend's name, so another plugin that
registers a backend under one of these names does not inherit the permission. `plugserve
plugins` shows it as "page>1+topk>1"; the engine refuses any other backend with that
combination, naming the backend, the combination and this list.
"""

from __future__ import annotations

import re

PAGE_TREE_WHITELIST: tuple[tuple[str, str], ...] = (
    ("plugserve", "torch_native"),
    ("plugserve-attention-triton", "triton"),
    ("plugserve-attention-flashinfer", "flashinfer"),
    ("plugserve-attention-fa3", "fa3"),
)


def canonical_distribution(name: str) -> str:
    """PEP 503 normalisation: `Plugserve_Attention.FA3` and `plugserve-attention-fa3` match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def whitelisted_for_page_tree(distribution: str, backend: str) -> bool:
    """Whether backend `backend`, registered by distribution `distribution`, is whitelisted."""
    dist = canonical_distribution(distribution)
    return any(dist == canonical_distribution(d) and backend == name
               for d, name in PAGE_TREE_WHITELIST)


def page_tree_whitelist_text() -> str:
    """The whitelist as errors and listings show it: `name (distribution)`, comma-separated."""
    return ", ".join(f"{name} ({dist})" for dist, name in PAGE_TREE_WHITELIST)
