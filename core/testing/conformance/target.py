"""The backend under test: its registry entry, class, capabilities and the device it runs on.

Resolved by name through the plugin host, exactly as the engine resolves
`EngineConfig.attention`, so the suite tests what `--attention NAME` would run. A device the
backend does not declare, or one this machine lacks, makes every suite test skip with the
reason (never fail): `plugserve conformance --attention fa3 --device cuda` on a CPU machine
reports skips, not errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plugserve.attention.base import AttentionBackend, AttentionContext, BackendCapabilities
from plugserve.registry import Entry, RegistryError


def default_device(capabilities: BackendCapabilities) -> str:
    """cpu when the backend declares it, else cuda."""
    return "cpu" if "cpu" in capabilities.devices or not capabilities.devices else "cuda"


@dataclass(frozen=True)
class BackendUnderTest:
    name: str
    entry: Entry[Any]
    device: str

    @classmethod
    def resolve(cls, name: str, device: str | None = None) -> BackendUnderTest:
        """The registered backend `name` (a `RegistryError` listing the names if unknown)."""
        from plugserve.plugins import get_plugin_host

        entry = get_plugin_host().registries.attention.get(name)
        if not isinstance(entry.capabilities, BackendCapabilities):
            raise RegistryError(f"attention backend {name!r} has no BackendCapabilities")
        return cls(name, entry, device or default_device(entry.capabilities))

    @property
    def capabilities(self) -> BackendCapabilities:
        caps: BackendCapabilities = self.entry.capabilities
        return caps

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def skip_reason(self) -> str | None:
        """Why no test can run here: a device the backend does not declare, or lacks here."""
        from plugserve.device import device_problems

        kind = self.device.split(":")[0]
        if kind not in self.capabilities.devices:
            return (f"attention backend {self.name!r} does not declare device {kind!r} "
                    f"(declares {sorted(self.capabilities.devices)})")
        problems = device_problems(self.device)
        return "; ".join(problems) if problems else None

    @property
    def backend_class(self) -> type[AttentionBackend]:
        """The registered class (loaded on first use, as the engine loads it)."""
        cls = self.entry.load()
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(
                f"attention backend {self.name!r}: its loader returned {cls!r}, not an "
                "AttentionBackend subclass"
            )
        return cls

    def build(self, ctx: AttentionContext) -> AttentionBackend:
        return self.backend_class(ctx)
