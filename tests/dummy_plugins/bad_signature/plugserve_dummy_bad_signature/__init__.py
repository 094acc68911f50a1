"""A test plugin whose hook asks for an argument (`options`) that its spec does not pass."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl


@hookimpl
def plugserve_register_cache_policies(register: Any, options: Any) -> None:
    register("never_registered", lambda: None)
