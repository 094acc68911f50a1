"""A test plugin whose hook name is misspelt (singular "backend"): plugserve has no such hook."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl


@hookimpl
def plugserve_register_attention_backend(register: Any) -> None:
    register("never_registered", lambda: None)
