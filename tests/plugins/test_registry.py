"""Registries: lookup by name, loaders, and `validate_config` gathering every reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from plugserve.attention.base import BackendCapabilities
from plugserve.attention.capabilities import TORCH_NATIVE_CAPABILITIES
from plugserve.config import EngineConfig
from plugserve.registry import (
    PAGE_TREE_WHITELIST,
    Entry,
    EntryLoadError,
    Registries,
    Registry,
    RegistryError,
    SpecCapabilities,
)
from plugserve.validation import validate_config

# Every capability a backend can declare (the whitelist is no capability).
FULL = dataclasses.replace(TORCH_NATIVE_CAPABILITIES, devices=frozenset({"cpu"}))
# The distribution the whitelist names for each whitelisted backend.
WHITELISTED_DIST = {name: dist for dist, name in PAGE_TREE_WHITELIST}


def entry(kind: str, name: str, caps: Any = None, loader: Any = lambda: object,
          distribution: str = "plugserve-test") -> Entry[Any]:
    return Entry(
        kind=kind,
        name=name,
        loader=loader,
        capabilities=caps,
        plugin="test",
        distribution=distribution,
        version="1.0",
    )


def registries(**backends: BackendCapabilities) -> Registries:
    """The built-in names plus `backends` (a whitelisted name registered by the distribution
    the whitelist names), a tree-capable `tree_spec` and a chain-only one."""
    regs = Registries()
    for name, caps in {"torch_native": TORCH_NATIVE_CAPABILITIES, **backends}.items():
        dist = WHITELISTED_DIST.get(name, "plugserve-test")
        regs.attention.add(entry("attention backend", name, caps, distribution=dist))
    regs.cache.add(entry("cache policy", "radix"))
    regs.spec.add(entry("speculative algorithm", "none", SpecCapabilities(topk_gt1=False)))
    regs.spec.add(entry("speculative algorithm", "tree_spec", SpecCapabilities()))
    regs.spec.add(
        entry(
            "speculative algorithm", "chain_spec", SpecCapabilities(topk_gt1=False, overlap=False)
        )
    )
    regs.spec.add(
        entry("speculative algorithm", "draft_spec", SpecCapabilities(needs_draft_model=True))
    )
    return regs


def test_unknown_name_lists_the_valid_ones() -> None:
    reg: Registry[Any] = Registry("attention backend")
    reg.add(entry("attention backend", "b"))
    reg.add(entry("attention backend", "a"))
    with pytest.raises(RegistryError, match=r"unknown attention backend 'c'; available: a, b"):
        reg.get("c")


def test_adding_a_name_twice_raises_naming_both() -> None:
    reg: Registry[Any] = Registry("cache policy")
    reg.add(entry("cache policy", "x"))
    with pytest.raises(RegistryError, match="cache policy 'x' is registered twice"):
        reg.add(entry("cache policy", "x"))


def test_entry_load_is_lazy_and_cached() -> None:
    calls: list[int] = []

    def loader() -> type:
        calls.append(1)
        return int

    e = entry("attention backend", "lazy", loader=loader)
    assert calls == []
    assert e.load() is int and e.load() is int
    assert calls == [1]


def test_entry_load_failure_names_the_plugin() -> None:
    def loader() -> Any:
        raise ImportError("no module named 'fancy_kernels'")

    with pytest.raises(EntryLoadError) as info:
        entry("attention backend", "fancy", loader=loader).load()
    assert str(info.value) == (
        "attention backend 'fancy' (plugin 'test', plugserve-test) could not be loaded: "
        "ImportError: no module named 'fancy_kernels'"
    )


def test_default_config_is_valid() -> None:
    assert validate_config(EngineConfig(), registries()) == []


def test_unknown_names_are_all_reported() -> None:
    config = EngineConfig(attention="nope", cache="lru", spec="medusa")
    reasons = validate_config(config, registries())
    assert reasons == [
        "unknown attention backend 'nope'; available: torch_native",
        "unknown cache policy 'lru'; available: radix",
        "unknown speculative algorithm 'medusa'; available: chain_spec, draft_spec, none, "
        "tree_spec",
    ]


def test_every_reason_is_gathered() -> None:
    narrow = BackendCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16"}),
        page_sizes=frozenset({16}),
        custom_mask=False,
    )
    config = EngineConfig(attention="narrow", spec="tree_spec", page_size=4, spec_topk=2)
    reasons = validate_config(config, registries(narrow=narrow))
    assert reasons == [
        "attention backend 'narrow' does not run on 'cpu'; it supports ['cuda']",
        "attention backend 'narrow' does not support dtype 'float32'; it supports ['bfloat16']",
        "attention backend 'narrow' does not support page_size 4; it supports [16]",
        "speculative decoding needs a tree-mask verify; attention backend 'narrow' has none",
        "attention backend 'narrow' (plugin 'test' (plugserve-test 1.0)) may not run "
        "page_size>1 (page_size=4) with topk>1 (spec_topk=2); allowed backends: "
        "torch_native (plugserve), triton (plugserve-attention-triton), flashinfer "
        "(plugserve-attention-flashinfer), fa3 (plugserve-attention-fa3)",
    ]


def test_only_the_whitelist_decides_page_gt1_with_topk_gt1() -> None:
    # Every capability a backend can declare, yet not on the whitelist: refused.
    config = EngineConfig(attention="capable", spec="tree_spec", page_size=16, spec_topk=4)
    reasons = validate_config(config, registries(capable=FULL))
    assert len(reasons) == 1 and "may not run page_size>1" in reasons[0]
    assert "page>1+topk>1" not in BackendCapabilities().as_dict()


def test_a_whitelisted_name_from_another_distribution_is_refused() -> None:
    """A third-party plugin registering a backend called `fa3` does not inherit fa3's place."""
    regs = registries()
    regs.attention.add(entry("attention backend", "fa3", FULL, distribution="someone-elses-fa3"))
    config = EngineConfig(attention="fa3", spec="tree_spec", page_size=16, spec_topk=4)
    (reason,) = validate_config(config, regs)
    assert reason.startswith("attention backend 'fa3' (plugin 'test' (someone-elses-fa3 1.0)) "
                             "may not run page_size>1 (page_size=16) with topk>1 (spec_topk=4)")
    assert "fa3 (plugserve-attention-fa3)" in reason
    # The distribution's name is compared as PEP 503 normalises it.
    real = entry("attention backend", "fa3", FULL, distribution="Plugserve_Attention.FA3")
    assert real.page_tree_allowed()


def test_the_defaults_claim_the_minimum() -> None:
    caps = BackendCapabilities()
    assert caps.devices == frozenset({"cpu"}) and caps.dtypes == frozenset({"float32"})
    assert caps.page_sizes == frozenset({1})
    assert not (caps.custom_mask or caps.topk_gt1 or caps.sliding_window
                or caps.swa_slot_translation)
    reasons = validate_config(
        EngineConfig(attention="bare", spec="tree_spec", page_size=4, dtype="bfloat16"),
        registries(bare=caps), sliding_window=True)
    assert len(reasons) == 4  # dtype, page size, window, tree mask: nothing was declared


def test_listing_shows_page_gt1_with_topk_gt1_from_the_whitelist() -> None:
    caps = BackendCapabilities()
    listed = entry("attention backend", "torch_native", caps,
                   distribution="plugserve").capabilities_dict()
    assert listed["page>1+topk>1"] is True
    assert list(listed)[list(listed).index("topk>1") + 1] == "page>1+topk>1"
    assert entry("attention backend", "capable", caps).capabilities_dict()["page>1+topk>1"] is False
    assert entry("attention backend", "torch_native", caps).capabilities_dict()[
        "page>1+topk>1"] is False  # the name alone is not enough
    # Only attention backends have the column.
    spec = entry("speculative algorithm", "tree_spec", SpecCapabilities()).capabilities_dict()
    assert "page>1+topk>1" not in spec


@pytest.mark.parametrize("backend", ["torch_native", "triton", "flashinfer", "fa3"])
def test_whitelisted_backends_may_run_page_gt1_with_topk_gt1(backend: str) -> None:
    assert (WHITELISTED_DIST[backend], backend) in PAGE_TREE_WHITELIST
    config = EngineConfig(attention=backend, spec="tree_spec", page_size=16, spec_topk=4)
    assert validate_config(config, registries(**{backend: FULL})) == []


def test_topk_gt1_at_page_size_one_is_a_separate_capability() -> None:
    no_tree = dataclasses.replace(FULL, topk_gt1=False)
    tree = EngineConfig(attention="no_tree", spec="tree_spec", page_size=1, spec_topk=2)
    assert validate_config(tree, registries(no_tree=no_tree)) == [
        "attention backend 'no_tree' does not support topk>1 drafting (spec_topk=2)"
    ]
    chain = EngineConfig(attention="no_tree", spec="tree_spec", page_size=1, spec_topk=1)
    assert validate_config(chain, registries(no_tree=no_tree)) == []


def test_spec_capabilities_are_checked() -> None:
    config = EngineConfig(spec="chain_spec", spec_topk=2, overlap=True)
    assert validate_config(config, registries()) == [
        "speculative algorithm 'chain_spec' does not support topk>1 (spec_topk=2); use spec_topk=1",
        "speculative algorithm 'chain_spec' does not support the overlap loop",
    ]
    assert validate_config(EngineConfig(spec="draft_spec"), registries()) == [
        "speculative algorithm 'draft_spec' needs a draft model; set draft_model "
        "(--draft-model PATH)"
    ]
    assert validate_config(EngineConfig(spec="draft_spec", draft_model="d"), registries()) == []


def test_sliding_window_models_need_a_sliding_window_backend() -> None:
    regs = registries(full_only=dataclasses.replace(FULL, sliding_window=False))
    config = EngineConfig(attention="full_only")
    assert validate_config(config, regs) == []
    assert validate_config(config, regs, sliding_window=True) == [
        "the model has sliding-window layers; attention backend 'full_only' does not support "
        "sliding windows"
    ]


def test_mem_check_needs_a_registered_checker() -> None:
    regs = registries()
    reasons = validate_config(EngineConfig(mem_check=1), regs)
    assert len(reasons) == 1 and "mem_check=1 needs an invariant checker" in reasons[0]
    regs.checkers.add(entry("invariant checker", "kv_conservation"))
    assert validate_config(EngineConfig(mem_check=1), regs) == []
