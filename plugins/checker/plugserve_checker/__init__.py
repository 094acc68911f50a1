"""plugserve invariant checker `kv_conservation` (minimal: see README)."""

from __future__ import annotations
