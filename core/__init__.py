"""plugserve: a small, pluggable LLM inference engine with accounted paged KV memory."""

from __future__ import annotations

__version__ = "0.1.0"

