"""The two hooks of an attention-backend plugin, made once: register the backend, and the fix
toggles it owns.

    plugserve_register_attention_backends, plugserve_register_fix_toggles = backend_plugin_hooks(
        "mine", load_backend, CAPABILITIES, description="...", fix_toggles=FIX_TOGGLES)

Assigned under those names in the plugin module (the one the entry point names), they are
that module's hook implementations. The marker is pluggy's for project "plugserve", the same
one as `plugserve.hookspecs.hookimpl` (pluggy tells implementations by that name alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from plugserve.attention.capabilities import BackendCapabilities

_hookimpl = pluggy.HookimplMarker("plugserve")

Hook = Callable[[Any], None]


def backend_plugin_hooks(
    name: str,
    loader: Callable[[], Any],
    capabilities: BackendCapabilities,
    *,
    description: str,
    fix_toggles: Mapping[str, str] | None = None,
    availability: Callable[[], str | None] | None = None,
) -> tuple[Hook, Hook]:
    """(`plugserve_register_attention_backends`, `plugserve_register_fix_toggles`) for one
    backend. `loader` runs only when the backend is selected; `availability`, a cheap probe
    returning why this machine cannot run it (or None), runs when `plugserve plugins` lists
    it."""
    toggles = dict(fix_toggles or {})

    @_hookimpl
    def plugserve_register_attention_backends(register: Any) -> None:
        register(name, loader, capabilities, description=description, availability=availability)

    @_hookimpl
    def plugserve_register_fix_toggles(register: Any) -> None:
        for toggle, what in toggles.items():
            register(toggle, what)

    return plugserve_register_attention_backends, plugserve_register_fix_toggles
