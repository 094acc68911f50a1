"""Whether a device string can be used on this machine, checked before anything is built.

`device_problems("cuda")` on a machine without CUDA says so (instead of torch's assertion
from deep inside model loading); `"cuda:N"` past the visible devices names how many there
are. The engine adds these reasons to its "unsupported configuration" error.
"""

from __future__ import annotations

import re

_DEVICE = re.compile(r"(?P<kind>cpu|cuda)(?::(?P<index>\d+))?")


def allowed_devices(device_count: int) -> list[str]:
    """The device strings usable with `device_count` visible CUDA devices."""
    if device_count <= 0:
        return ["cpu"]
    return ["cpu", "cuda", *(f"cuda:{i}" for i in range(device_count))]


def device_problems(device: str) -> list[str]:
    """Reasons `device` cannot be used here (empty when it can). Imports torch."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        return [f"device must be 'cpu' or 'cuda[:N]', got {device!r}"]
    if match["kind"] == "cpu":
        if match["index"] is not None and int(match["index"]) != 0:
            return [f"device {device!r}: the CPU has only index 0; allowed: 'cpu'"]
        return []

    import torch

    if not torch.cuda.is_available():
        build = torch.__version__
        why = (
            f"this PyTorch build ({build}) has no CUDA support"
            if torch.version.cuda is None
            else f"no CUDA device is visible to PyTorch {build} (CUDA {torch.version.cuda})"
        )
        return [f"device {device!r} was requested but CUDA is not available: {why}; "
                "allowed here: 'cpu'"]
    count = torch.cuda.device_count()
    index = match["index"]
    if index is not None and int(index) >= count:
        allowed = ", ".join(repr(d) for d in allowed_devices(count))
        return [f"device {device!r} names CUDA device {index}, but only {count} "
                f"{'is' if count == 1 else 'are'} visible; allowed here: {allowed}"]
    return []
