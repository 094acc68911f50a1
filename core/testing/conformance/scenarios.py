"""Kernel scenarios: which batch a case builds, and what the backend must declare to run it.

Each scenario builds one `ForwardBatch` over a shuffled paged cache (`paged.BatchFactory`)
with two attention layers. Lengths are deliberately uneven (1 token next to hundreds) and
cross page boundaries at every page size of the sample.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plugserve.pools.kv_pool import kv_cache_torch_dtype
from plugserve.structs.forward_batch import ForwardBatch, ForwardMode
from plugserve.testing.conformance.cases import Shape, kv_cache_dtype_shapes, pairwise_shapes
from plugserve.testing.conformance.paged import BatchFactory, narrow_kv_pool

LAYER_IDS = (3, 6)  # two layers: metadata is built once and must serve every layer
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Built:
    fb: ForwardBatch
    window: int | None = None
    spec_topk: int = 1
    num_requests: int = 0  # requests behind the batch (branches are not requests)


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[BatchFactory, Shape, int], Built]
    requirements: tuple[str, ...] = ()
    # Extra requirements that depend on the shape (page size decides page_tree vs topk_gt1).
    shape_requirements: Callable[[Shape], tuple[str, ...]] = field(default=lambda shape: ())
    # The shapes it runs on, from the scenario's name (the pairwise sample unless given).
    shapes: Callable[[str], list[Shape]] = pairwise_shapes


@dataclass(frozen=True)
class KernelCase:
    scenario: Scenario
    shape: Shape
    index: int  # position in the scenario's sample: picks windows, topk and steps

    @property
    def id(self) -> str:
        return self.shape.id

    @property
    def requirements(self) -> tuple[str, ...]:
        return (*self.scenario.requirements, *self.shape.requirements,
                *self.scenario.shape_requirements(self.shape))

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.scenario.name}/{self.id}".encode()) % 100_000

    def build(self, factory: BatchFactory) -> Built:
        built = self.scenario.build(factory, self.shape, self.index)
        if self.shape.kv_cache_dtype != "auto":  # the pool stores the narrower dtype
            narrow_kv_pool(built.fb.kv_pool, kv_cache_torch_dtype(
                self.shape.kv_cache_dtype, DTYPES[self.shape.dtype]))
        return built


def _common(shape: Shape) -> dict[str, object]:
    return {"page_size": shape.page_size, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "dtype": DTYPES[shape.dtype], "layer_ids": LAYER_IDS}


def _extend(prefix: list[int], extend: list[int], mode: ForwardMode = ForwardMode.EXTEND,
            *, tree: bool = False, windows: tuple[int, ...] = ()) -> Callable[..., Built]:
    def build(factory: BatchFactory, shape: Shape, index: int) -> Built:
        fb = factory.extend_batch(prefix_lens=prefix, extend_lens=extend, tree_mask=tree,
                                  mode=mode, **_common(shape))
        window = windows[index % len(windows)] if windows else None
        return Built(fb, window, num_requests=len(prefix))

    return build


def _decode(seq_lens: list[int], mode: ForwardMode = ForwardMode.DECODE,
            windows: tuple[int, ...] = ()) -> Callable[..., Built]:
    def build(factory: BatchFactory, shape: Shape, index: int) -> Built:
        fb = factory.decode_batch(seq_lens=seq_lens, mode=mode, **_common(shape))
        window = windows[index % len(windows)] if windows else None
        return Built(fb, window, num_requests=len(seq_lens))

    return build


def _topk_draft_decode(factory: BatchFactory, shape: Shape, index: int) -> Built:
    prefix = [1, 9, 30, 67]
    topk = (2, 4)[index % 2]
    fb, _ = factory.draft_decode_batch(prefix_lens=prefix, topk=topk, step=index % 3,
                                       num_steps=3, lane_entries=True,
                                       **_common(shape))
    return Built(fb, spec_topk=topk, num_requests=len(prefix))


def _branch_requirement(shape: Shape) -> tuple[str, ...]:
    return ("page_tree",) if shape.page_size > 1 else ("topk_gt1",)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    # Prefill of whole prompts of very different lengths.
    Scenario("prefill", _extend([0, 0, 0], [1, 37, 150])),
    # Chunked prefill: new tokens after a cached prefix (the causal mask is offset by it).
    Scenario("extend_prefix", _extend([5, 64, 130, 3], [9, 1, 34, 70])),
    # Mixed chunk: a long new prefill next to decoding requests (one new token each).
    Scenario("mixed", _extend([200, 0, 63, 17, 1], [1, 120, 1, 40, 1])),
    Scenario("decode", _decode([1, 7, 70, 300])),
    # The draft model catching up on accepted tokens (causal, like extend).
    Scenario("draft_extend", _extend([9, 40, 2], [3, 2, 4], ForwardMode.DRAFT_EXTEND),
             ("speculative",)),
    # Speculative verify: random draft trees under a custom mask.
    Scenario("tree_verify", _extend([7, 40, 129], [6, 9, 4], ForwardMode.TARGET_VERIFY,
                                    tree=True), ("custom_mask",)),
    # A chain draft step (topk 1): no KV lists, one query per request reading its row.
    Scenario("chain_draft_decode", _decode([4, 19, 77], ForwardMode.DRAFT_DECODE),
             ("speculative",)),
    # Tree drafting: one query per branch reading its own KV list (holey layout at page>1).
    Scenario("topk_draft_decode", _topk_draft_decode,
             shape_requirements=_branch_requirement),
    Scenario("window_extend", _extend([0, 11, 30], [21, 6, 40], windows=(1, 5, 16)),
             ("sliding_window",)),
    Scenario("window_decode", _decode([3, 17, 64, 130], windows=(1, 4, 40)),
             ("sliding_window",)),
    # Tree verify on a sliding-window layer: the window counts positions, not tree indices.
    Scenario("tree_window", _extend([20, 33], [7, 9], ForwardMode.TARGET_VERIFY, tree=True,
                                    windows=(3, 5, 8)), ("custom_mask", "sliding_window")),
    # A KV cache narrower than the queries (bf16, fp8): the new K/V stored as the cache's
    # dtype stores them, the cached ones read widened; the oracle reads the same stored values.
    Scenario("kv_dtype_extend", _extend([0, 64, 130, 3], [37, 1, 34, 70]),
             shapes=kv_cache_dtype_shapes),
    Scenario("kv_dtype_decode", _decode([1, 7, 70, 300]), shapes=kv_cache_dtype_shapes),
]}


def kernel_cases(scenario: str) -> list[KernelCase]:
    """The scenario's deterministic pairwise sample of shapes, as cases."""
    spec = SCENARIOS[scenario]
    return [KernelCase(spec, shape, i) for i, shape in enumerate(spec.shapes(scenario))]


def kernel_case(scenario: str, shape: Shape, index: int = 0) -> KernelCase:
    """One hand-picked case (the smoke suite's)."""
    return KernelCase(SCENARIOS[scenario], shape, index)
