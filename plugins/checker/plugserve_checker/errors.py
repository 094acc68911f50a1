"""Errors the checker raises. A leak stops the engine from serving."""

from __future__ import annotations


class KVAccountingError(RuntimeError):
    """A KV accounting invariant does not hold; the message names the pool and every term."""


class KVLeakError(KVAccountingError):
    """The conservation law failed for a pool."""


class KVCorruptionError(KVAccountingError):
    """A physical check failed: bad lengths, use after free or double free."""
