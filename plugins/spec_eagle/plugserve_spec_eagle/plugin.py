"""Registers the `eagle` speculative algorithm and its capabilities."""

from __future__ import annotations

from typing import Any

from plugserve.hookspecs import hookimpl
from plugserve.registry import RegisterSpecAlgorithm, SpecCapabilities

CAPABILITIES = SpecCapabilities(topk_gt1=True, overlap=True, needs_draft_model=True)


def _load() -> Any:
    from plugserve_spec_eagle.algorithm import EagleNotBuilt

    return EagleNotBuilt


@hookimpl
def plugserve_register_spec_algorithms(register: RegisterSpecAlgorithm) -> None:
    register(
        "eagle",
        _load,
        CAPABILITIES,
        description="EAGLE draft model; chain (topk 1) or tree (topk>1); v1 sync, v2 overlap",
    )
