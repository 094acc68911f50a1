"""Kernel-case shapes: a deterministic sample of the page size x GQA x head dim x dtype space.

The full cross-product (4 x 3 x 2 x 3 = 72 shapes per scenario) is more than a CPU run can
afford, so each scenario gets a pairwise covering sample: every pair of values of any two
axes appears in at least one of its shapes (about a dozen), picked greedily from an order
shuffled by a seed derived from the scenario's name. Same plugserve version, same cases.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

PAGE_SIZES = (1, 2, 16, 64)
GQA_RATIOS = (1, 3, 4)  # query heads per KV head
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16", "float16")
NUM_KV_HEADS = 2
# A KV cache narrower than the queries (`EngineConfig.kv_cache_dtype`; "auto" = the queries').
KV_CACHE_DTYPES = ("bfloat16", "float8_e4m3", "float8_e5m2")

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3": "e4m3",
          "float8_e5m2": "e5m2"}


@dataclass(frozen=True)
class Shape:
    page_size: int
    gqa: int
    head_dim: int
    dtype: str
    num_kv_heads: int = NUM_KV_HEADS
    kv_cache_dtype: str = "auto"  # what the KV pool stores; "auto" = `dtype`

    @property
    def num_heads(self) -> int:
        return self.gqa * self.num_kv_heads

    @property
    def id(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f"-kv{_SHORT[self.kv_cache_dtype]}"
        return f"page{self.page_size}-gqa{self.gqa}-hd{self.head_dim}-{_SHORT[self.dtype]}{kv}"

    @property
    def requirements(self) -> tuple[str, ...]:
        kv = () if self.kv_cache_dtype == "auto" else (f"kv_cache_dtype:{self.kv_cache_dtype}",)
        return (f"dtype:{self.dtype}", f"page_size:{self.page_size}", *kv)


Combo = tuple[int, int, int, str]
Pair = tuple[int, object, int, object]


def _pairs(combo: Sequence[object]) -> set[Pair]:
    return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(range(len(combo)), 2)}


def pairwise_shapes(
    seed: str,
    page_sizes: Sequence[int] = PAGE_SIZES,
    gqa_ratios: Sequence[int] = GQA_RATIOS,
    head_dims: Sequence[int] = HEAD_DIMS,
    dtypes: Sequence[str] = DTYPES,
) -> list[Shape]:
    """A small set of shapes covering every pair of axis values (see the module docstring)."""
    combos: list[Combo] = list(itertools.product(page_sizes, gqa_ratios, head_dims, dtypes))
    random.Random(seed).shuffle(combos)
    uncovered: set[Pair] = set().union(*(_pairs(c) for c in combos))
    chosen: list[Combo] = []
    while uncovered:
        best = max(combos, key=lambda c: len(_pairs(c) & uncovered))  # first best: stable
        chosen.append(best)
        uncovered -= _pairs(best)
    return [Shape(*combo) for combo in chosen]


def kv_cache_dtype_shapes(seed: str) -> list[Shape]:
    """Every narrower KV cache dtype under each query dtype wider than it (fp32 and bf16
    queries; a bf16 cache under bf16 queries is "auto"), page size, GQA and head dim cycling
    through their values so that each appears. `seed` is unused: the list is fixed."""
    del seed
    pairs = [(q, kv) for kv in KV_CACHE_DTYPES for q in ("float32", "bfloat16") if q != kv]
    return [
        Shape(PAGE_SIZES[i % len(PAGE_SIZES)], GQA_RATIOS[i % len(GQA_RATIOS)],
              HEAD_DIMS[i % len(HEAD_DIMS)], q, kv_cache_dtype=kv)
        for i, (q, kv) in enumerate(pairs)
    ]
