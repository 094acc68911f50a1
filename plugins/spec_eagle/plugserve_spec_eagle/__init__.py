"""plugserve speculative algorithm `eagle` (skeleton: registration only, see README)."""

from __future__ import annotations
