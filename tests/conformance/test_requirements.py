"""Requirements from capabilities: what a backend does not declare is skipped with the reason,
unknown names are not required, the whitelist decides page>1+topk>1, a missing device skips.
And the kernel sample is a deterministic pairwise cover."""

from __future__ import annotations

import itertools

import pytest
import torch

from plugserve.attention.base import BackendCapabilities
from plugserve.attention.capabilities import TORCH_NATIVE_CAPABILITIES
from plugserve.registry import PAGE_TREE_WHITELIST, Entry
from plugserve.testing.conformance import Requirements, requires
from plugserve.testing.conformance.cases import (
    DTYPES,
    GQA_RATIOS,
    HEAD_DIMS,
    PAGE_SIZES,
    pairwise_shapes,
)
from plugserve.testing.conformance.requirements import declared_requirements
from plugserve.testing.conformance.target import BackendUnderTest, default_device

NARROW = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}),
                             page_sizes=frozenset({16}), custom_mask=False, topk_gt1=False,
                             sliding_window=False)


FULL = TORCH_NATIVE_CAPABILITIES


def _target(name: str, caps: BackendCapabilities, device: str | None = None,
            distribution: str = "") -> BackendUnderTest:
    entry: Entry[object] = Entry(kind="attention backend", name=name, loader=object,
                                 capabilities=caps, distribution=distribution)
    return BackendUnderTest(name, entry, device or default_device(caps))


def test_declared_capabilities_are_met() -> None:
    req = Requirements(_target("torch_native", FULL, distribution="plugserve"))
    names = ["dtype:float16", "page_size:64", "custom_mask", "speculative", "topk_gt1",
             "page_tree", "sliding_window"]
    assert req.unmet(names) == []


def test_undeclared_capabilities_give_reasons() -> None:
    req = Requirements(_target("narrow", NARROW))
    assert "does not declare dtype 'float32'" in str(req.check("dtype:float32"))
    assert req.check("dtype:bfloat16") is None
    assert "does not declare page_size 1 (declares [16])" in str(req.check("page_size:1"))
    assert req.check("page_size:16") is None
    # custom_mask=False refuses all speculative decoding, not just tree drafting.
    for name in ("custom_mask", "speculative", "topk_gt1", "page_tree"):
        assert "custom_mask=False" in str(req.check(name)), name
    assert "sliding_window=False" in str(req.check("sliding_window"))


def test_the_whitelist_decides_page_gt1_with_topk_gt1() -> None:
    assert ("plugserve-attention-triton", "triton") in PAGE_TREE_WHITELIST
    triton = _target("triton", FULL, distribution="plugserve-attention-triton")
    assert Requirements(triton).check("page_tree") is None
    reason = Requirements(_target("mine", FULL)).check("page_tree")
    assert "not in plugserve.registry.PAGE_TREE_WHITELIST" in str(reason)
    # The name alone inherits nothing: another distribution's "triton" is refused.
    assert "not in plugserve.registry" in str(Requirements(_target("triton", FULL)).check(
        "page_tree"))
    assert Requirements(_target("mine", FULL)).check("topk_gt1") is None


def test_unknown_requirement_is_not_required_until_opted_in() -> None:
    target = _target("narrow", NARROW)
    for name in ("fp8_kv", "fp8_kv:e4m3", "unmet", "_private", "not-a-name"):
        assert "not required" in str(Requirements(target).check(name)), name

    class OptedIn(Requirements):
        def fp8_kv(self) -> str | None:
            return None

    assert OptedIn(target).check("fp8_kv") is None


def test_requires_marks_functions_and_classes() -> None:
    @requires("custom_mask")
    @requires("dtype:float16")
    def test_x() -> None: ...

    @requires("sliding_window")
    class TestY: ...

    class Case:
        requirements = ("page_size:2",)

    assert sorted(declared_requirements(TestY, test_x, Case(), 3)) == [
        "custom_mask", "dtype:float16", "page_size:2", "sliding_window"]


def test_known_failures_by_test_or_case() -> None:
    class Known(Requirements):
        known_failures = {"test_a": "bug a", "test_b[case1]": "bug b"}

    req = Known(_target("x", BackendCapabilities()))
    assert req.known_failure("test_a[any]") == "bug a"
    assert req.known_failure("test_b[case1]") == "bug b"
    assert req.known_failure("test_b[case2]") is None


def test_device_the_backend_lacks_or_this_machine_lacks() -> None:
    assert default_device(NARROW) == "cuda"
    assert "does not declare device 'cpu'" in str(_target("n", NARROW, "cpu").skip_reason())
    cpu = _target("torch_native", FULL)
    assert cpu.device == "cpu" and cpu.skip_reason() is None
    if not torch.cuda.is_available():
        assert "CUDA is not available" in str(_target("n", NARROW).skip_reason())


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; available:") as err:
        BackendUnderTest.resolve("nope")
    assert "torch_native" in str(err.value)


def test_pairwise_sample_covers_every_pair_deterministically() -> None:
    shapes = pairwise_shapes("decode")
    assert shapes == pairwise_shapes("decode")
    assert len(shapes) < len(PAGE_SIZES) * len(GQA_RATIOS) * len(HEAD_DIMS) * len(DTYPES) / 4
    rows = [(s.page_size, s.gqa, s.head_dim, s.dtype) for s in shapes]
    axes = [PAGE_SIZES, GQA_RATIOS, HEAD_DIMS, DTYPES]
    for a, b in itertools.combinations(range(4), 2):
        for va, vb in itertools.product(axes[a], axes[b]):
            assert any(r[a] == va and r[b] == vb for r in rows), (a, va, b, vb)
