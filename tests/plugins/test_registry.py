"""Registries: lookup by name, loaders, and `validate_config` gathering every reason."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.attention.base import BackendCapabilities
from plugserve.config import EngineConfig
from plugserve.registry import (
    PAGE_TREE_WHITELIST,
    Entry,
    EntryLoadError,
    Registries,
    Registry,
    RegistryError,
    SpecCapabilities,
    validate_config,
)


def entry(kind: str, name: str, caps: Any = None, loader: Any = lambda: object) -> Entry[Any]:
    return Entry(
        kind=kind,
        name=name,
        loader=loader,
        capabilities=caps,
        plugin="test",
        distribution="plugserve-test",
        version="1.0",
    )


def registries(**backends: BackendCapabilities) -> Registries:
    """The built-in names plus `backends`, a tree-capable `tree_spec` and a chain-only one."""
    regs = Registries()
    for name, caps in {"torch_native": BackendCapabilities(), **backends}.items():
        regs.attention.add(entry("attention backend", name, caps))
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
        "attention backend 'narrow' may not run page_size>1 (page_size=4) with topk>1 "
        f"(spec_topk=2); allowed backends: {', '.join(PAGE_TREE_WHITELIST)}",
    ]


def test_only_the_whitelist_decides_page_gt1_with_topk_gt1() -> None:
    # Every capability a backend can declare, yet not on the whitelist: refused.
    capable = BackendCapabilities(topk_gt1=True, custom_mask=True)
    config = EngineConfig(attention="capable", spec="tree_spec", page_size=16, spec_topk=4)
    reasons = validate_config(config, registries(capable=capable))
    assert len(reasons) == 1 and "may not run page_size>1" in reasons[0]
    assert "page>1+topk>1" not in BackendCapabilities().as_dict()


def test_listing_shows_page_gt1_with_topk_gt1_from_the_whitelist() -> None:
    caps = BackendCapabilities()
    listed = entry("attention backend", "torch_native", caps).capabilities_dict()
    assert listed["page>1+topk>1"] is True
    assert list(listed)[list(listed).index("topk>1") + 1] == "page>1+topk>1"
    assert entry("attention backend", "capable", caps).capabilities_dict()["page>1+topk>1"] is False
    # Only attention backends have the column.
    spec = entry("speculative algorithm", "tree_spec", SpecCapabilities()).capabilities_dict()
    assert "page>1+topk>1" not in spec


@pytest.mark.parametrize("backend", ["torch_native", "triton", "flashinfer", "fa3"])
def test_whitelisted_backends_may_run_page_gt1_with_topk_gt1(backend: str) -> None:
    assert backend in PAGE_TREE_WHITELIST
    config = EngineConfig(attention=backend, spec="tree_spec", page_size=16, spec_topk=4)
    assert validate_config(config, registries(**{backend: BackendCapabilities()})) == []


def test_topk_gt1_at_page_size_one_is_a_separate_capability() -> None:
    no_tree = BackendCapabilities(topk_gt1=False)
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
    regs = registries(full_only=BackendCapabilities(sliding_window=False))
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
