"""The CUDA compile check: compile, without a GPU, exactly what the Triton backend's launches
compile for sm_80 and sm_90, and hold every kernel to a register-spill and shared-memory
budget.

    python plugins/attention_triton/tests/cuda_compile_check.py [--arch 80] [--jobs 2]

For every variant (dtype x head_dim x page size x GQA/MHA x scenario: causal extend, sliding
window, tree mask, tree mask + window, decode, decode split up to 4 and up to 8 ways,
windowed decode, windowed split decode, topk>1 draft decode) it builds a real batch on the CPU (the conformance suite's shuffled paged caches),
the backend's metadata for it with the backend's CUDA split settings, and the launches the
kernels' own launchers make for that compute capability (`extend_launch`,
`decode_launches`). Each launch goes through Triton's own launch path with `warmup=True`
(`KernelLaunch.compile`): Triton's binder specialises the real arguments (divisibility-by-16
hints on pointers and integers, integers equal to 1 as constants, constexprs) and compiles
with its bundled ptxas for a `GPUTarget("cuda", arch, 32)` given by a compile-only driver.
Launches that specialise alike get the same kernel, so the table has one row per distinct
kernel and lists the variants that launch it.

Budgets (the run fails on any excess, and on any compiler error):
- spill stores: none for bf16/fp16, none for fp32 (see `SPILL_STORE_BUDGET_BYTES`);
- shared memory: the architecture's per-block opt-in limit (`SHARED_LIMIT_BYTES`).

Compiled kernels and their ptxas figures are cached under Triton's cache directory, keyed by
Triton's own hash of the kernel source, specialisation, options, target and Triton version,
so a second run compiles nothing that did not change. Exit status: 0 pass, 1 fail, 2 Triton's
CUDA toolchain cannot run on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

_PLUGIN_ROOT = Path(__file__).resolve().parents[1]
if str(_PLUGIN_ROOT) not in sys.path:
    sys.path.insert(0, str(_PLUGIN_ROOT))

import torch  # noqa: E402
from cuda_compile_toolchain import compile_only, compile_with_figures, ptxas_usable  # noqa: E402

ARCHS = (80, 90)
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (1, 16)
# (query heads, KV heads): grouped-query attention (4 query heads per KV head) and MHA.
HEADS = {"GQA": (8, 2), "MHA": (4, 4)}
EXTEND_SCENARIOS = ("causal", "window", "tree", "tree+window")
DECODE_SCENARIOS = ("decode", "split4", "split8", "window", "split8+window", "topk4")
WINDOW = 48
# The dequantize-matmul (kernels/quant_matmul.py): every type, x dtype and row regime
# (decode rows <= 16, prefill rows) at a SmolLM2-sized K and N.
QUANT_TYPES = ("q8_0", "q4_k", "q6_k")
QUANT_ROWS = (1, 256)
QUANT_K, QUANT_N = 1536, 576

# Per-block shared memory a kernel may use (cudaDevAttrMaxSharedMemoryPerBlockOptin, which
# Triton checks at load): A100 163 KiB, H100 227 KiB.
SHARED_LIMIT_BYTES = {80: 163 * 1024, 90: 227 * 1024}
# Bytes of spill stores per thread allowed. Zero everywhere: a spill is local memory traffic
# inside the KV loop. fp32 runs on the FMA units with tiles sized to fit the registers.
SPILL_STORE_BUDGET_BYTES = {"bfloat16": 0, "float16": 0, "float32": 0}


@dataclass(frozen=True)
class Variant:
    kind: str  # "extend" or "decode"
    scenario: str
    dtype: str
    head_dim: int
    page_size: int
    heads: str

    @property
    def label(self) -> str:
        return (f"{self.kind} {self.scenario} {self.dtype} d{self.head_dim} "
                f"p{self.page_size} {self.heads}")


@dataclass(frozen=True)
class QuantVariant:
    qtype: str
    dtype: str
    rows: int

    @property
    def label(self) -> str:
        # Six words like an attention variant's, so the table and its sorting read them.
        return f"quant {self.qtype} {self.dtype} k{QUANT_K} m{self.rows} N{QUANT_N}"


def quant_variants() -> list[QuantVariant]:
    return [QuantVariant(qtype, dtype, rows)
            for qtype in QUANT_TYPES for dtype in DTYPES for rows in QUANT_ROWS]


def quant_launch(variant: QuantVariant, arch: int) -> object:
    """The launch `quant_matmul` makes for this variant on `arch` (random blocks)."""
    from plugserve_attention_triton.kernels.quant_matmul import (
        BLOCK_BYTES,
        BLOCK_ELEMS,
        quant_matmul_launch,
    )

    dtype = getattr(torch, variant.dtype)
    row_bytes = QUANT_K // BLOCK_ELEMS[variant.qtype] * BLOCK_BYTES[variant.qtype]
    w = torch.randint(0, 256, (QUANT_N, row_bytes), dtype=torch.uint8)
    x = torch.randn(variant.rows, QUANT_K).to(dtype)
    out = torch.empty(variant.rows, QUANT_N, dtype=dtype)
    return quant_matmul_launch(x, w, variant.qtype, QUANT_N, QUANT_K, out, arch=arch)


def all_variants() -> list[Variant]:
    return [
        Variant(kind, scenario, dtype, head_dim, page_size, heads)
        for kind, scenarios in (("extend", EXTEND_SCENARIOS), ("decode", DECODE_SCENARIOS))
        for scenario in scenarios
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for page_size in PAGE_SIZES
        for heads in HEADS
    ]


@dataclass
class CompiledRow:
    """One launch of one variant for one architecture, and what ptxas made of its kernel."""

    arch: int
    variant: str
    kernel: str
    dtype: str
    hash: str = ""
    constexprs: str = ""
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_bytes: int = -1
    shared_bytes: int = -1
    num_warps: int = 0
    num_stages: int = 0
    compile_s: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)


# --- building the launches of a variant ------------------------------------------------------


def variant_launches(variant: Variant, arch: int) -> list[tuple[str, object]]:
    """(kernel role, KernelLaunch) of every launch the backend makes for this variant."""
    from plugserve.attention.paging import decode_slot_lists
    from plugserve.structs.forward_batch import ForwardMode
    from plugserve.testing.conformance.paged import BatchFactory
    from plugserve_attention_triton.backend import (
        CUDA_MAX_KV_SPLITS,
        CUDA_MIN_TOKENS_PER_SPLIT,
    )
    from plugserve_attention_triton.kernels import decode_launches, extend_launch
    from plugserve_attention_triton.metadata import (
        build_decode_metadata,
        build_extend_metadata,
    )

    dtype = getattr(torch, variant.dtype)
    num_heads, num_kv_heads = HEADS[variant.heads]
    factory = BatchFactory(device="cpu", seed=sum(map(ord, variant.label)))
    shape = dict(page_size=variant.page_size, num_kv_heads=num_kv_heads,
                 head_dim=variant.head_dim, dtype=dtype)
    windowed = "window" in variant.scenario
    if variant.kind == "extend":
        if variant.scenario.startswith("tree"):
            fb = factory.extend_batch(prefix_lens=[40, 17], extend_lens=[8, 6], tree_mask=True,
                                      mode=ForwardMode.TARGET_VERIFY, **shape)
        else:
            fb = factory.extend_batch(prefix_lens=[0, 37], extend_lens=[70, 5], **shape)
        meta = build_extend_metadata(fb)
    else:
        if variant.scenario == "topk4":
            fb, _ = factory.draft_decode_batch(prefix_lens=[5, 40], topk=4, step=1,
                                               num_steps=3, **shape)
        else:
            # Up to 4 or 8 splits (256 keys each at least, CUDA_MAX_KV_SPLITS at most).
            seq_lens = {"split4": [300, 1000], "split8": [300, 2100]}.get(
                variant.scenario.split("+")[0], [3, 40])
            fb = factory.decode_batch(seq_lens=seq_lens, **shape)
        kv_indptr_cpu, kv_indices = decode_slot_lists(fb)
        meta = build_decode_metadata(kv_indptr_cpu=kv_indptr_cpu, kv_indices=kv_indices,
                                     max_kv_splits=CUDA_MAX_KV_SPLITS,
                                     min_tokens_per_split=CUDA_MIN_TOKENS_PER_SPLIT)
    head_dim = variant.head_dim
    # q as the model hands it over: a view into the qkv projection's output.
    qkv = factory.randn(fb.num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        fb.num_tokens, num_heads + num_kv_heads, head_dim)
    q = qk.split([num_heads, num_kv_heads], dim=1)[0]
    layer_id = fb.kv_pool.layer_ids[0]
    k_buffer, v_buffer = fb.kv_pool.get_k(layer_id), fb.kv_pool.get_v(layer_id)
    out = torch.empty_like(q)
    common = dict(scaling=head_dim**-0.5, sliding_window=WINDOW if windowed else None,
                  arch=arch)
    if variant.kind == "extend":
        return [("extend", extend_launch(q, k_buffer, v_buffer, out, meta, **common))]
    partial, reduce = decode_launches(q, k_buffer, v_buffer, out, meta, **common)
    return [("decode_partial", partial), ("decode_reduce", reduce)]


# --- compiling ------------------------------------------------------------------------------


def compile_arch(arch: int, variants: list[Variant], quant: bool = True) -> list[CompiledRow]:
    rows: list[CompiledRow] = []
    seen: dict[str, dict[str, int]] = {}
    with compile_only(arch):
        for variant in variants:
            try:
                launches = variant_launches(variant, arch)
            except Exception as exc:
                rows.append(CompiledRow(arch, variant.label, "?", variant.dtype,
                                        error=f"building the launch: {type(exc).__name__}: {exc}"))
                continue
            for role, launch in launches:
                row = CompiledRow(arch, variant.label, role, variant.dtype)
                begin = time.perf_counter()
                try:
                    kernel, figures = compile_with_figures(launch, seen)
                except Exception as exc:  # a compiler error is a result: report, go on
                    row.error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
                    rows.append(row)
                    continue
                row.compile_s = round(time.perf_counter() - begin, 2)
                meta = kernel.metadata
                row.hash = kernel.hash
                row.constexprs = _constexpr_text(launch)
                row.shared_bytes = int(meta.shared)
                row.num_warps, row.num_stages = int(meta.num_warps), int(meta.num_stages)
                for name, value in figures.items():
                    setattr(row, name, value)
                rows.append(row)
        rows += _warm_up_rows(arch, seen, {(v.dtype, v.head_dim, v.heads) for v in variants})
        if quant:
            rows += _quant_rows(arch, seen)
    return rows


def _quant_rows(arch: int, seen: dict[str, dict[str, int]]) -> list[CompiledRow]:
    rows = []
    for variant in quant_variants():
        row = CompiledRow(arch, variant.label, "quant_matmul", variant.dtype)
        begin = time.perf_counter()
        try:
            launch = quant_launch(variant, arch)
            kernel, figures = compile_with_figures(launch, seen)
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
            rows.append(row)
            continue
        row.compile_s = round(time.perf_counter() - begin, 2)
        row.hash, row.shared_bytes = kernel.hash, int(kernel.metadata.shared)
        row.constexprs = _constexpr_text(launch)
        row.num_warps, row.num_stages = kernel.metadata.num_warps, kernel.metadata.num_stages
        for name, value in figures.items():
            setattr(row, name, value)
        rows.append(row)
    return rows


WARM_UP = "warm-up"


def _warm_up_rows(
    arch: int, seen: dict[str, dict[str, int]], shapes: set[tuple[str, int, str]]
) -> list[CompiledRow]:
    """What the backend compiles at engine start for each model shape (`warmup.py`)."""
    from plugserve_attention_triton.backend import CUDA_MAX_KV_SPLITS
    from plugserve_attention_triton.kernels.warmup import model_launches

    rows = []
    for dtype, head_dim, heads in sorted(shapes):
        num_heads, num_kv_heads = HEADS[heads]
        label = f"{WARM_UP} start {dtype} d{head_dim} p0 {heads}"
        launches = model_launches(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, dtype=getattr(torch, dtype),
                                  device=torch.device("cpu"), arch=arch,
                                  max_kv_splits=CUDA_MAX_KV_SPLITS)
        for launch in launches:
            row = CompiledRow(arch, label, _ROLES[launch.kernel_name], dtype)
            try:
                kernel, figures = compile_with_figures(launch, seen)
            except Exception as exc:
                row.error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
                rows.append(row)
                continue
            row.hash, row.shared_bytes = kernel.hash, int(kernel.metadata.shared)
            row.num_warps, row.num_stages = kernel.metadata.num_warps, kernel.metadata.num_stages
            for name, value in figures.items():
                setattr(row, name, value)
            rows.append(row)
    return rows


_ROLES = {"_extend_kernel": "extend", "_decode_partial_kernel": "decode_partial",
          "_decode_reduce_kernel": "decode_reduce"}


def _constexpr_text(launch: object) -> str:
    options = launch.options  # type: ignore[attr-defined]
    return " ".join(f"{k}={v}" for k, v in options.items())


# --- budgets and the table ------------------------------------------------------------------


def judge(rows: list[CompiledRow]) -> None:
    for row in rows:
        if row.error:
            row.problems.append(f"compile error: {row.error}")
            continue
        budget = SPILL_STORE_BUDGET_BYTES[row.dtype]
        if row.spill_stores > budget:
            row.problems.append(f"{row.spill_stores} bytes of spill stores (budget {budget})")
        limit = SHARED_LIMIT_BYTES[row.arch]
        if row.shared_bytes > limit:
            row.problems.append(f"{row.shared_bytes} bytes of shared memory (sm_{row.arch} "
                                f"allows {limit})")


def judge_warm_up(rows: list[CompiledRow]) -> list[str]:
    """The engine-start warm-up must compile exactly the kernels real batches of the same
    model shape launch: none missing (a stall at a first batch) and none extra (a wasted
    compile, or a launch that specialises differently from the real one)."""
    launched: dict[tuple[int, str, str], set[str]] = {}
    warmed: dict[tuple[int, str, str], set[str]] = {}
    for row in rows:
        if row.variant.startswith("quant "):  # not an attention kernel: no engine warm-up
            continue
        _, _, dtype, head_dim, _, heads = row.variant.split()
        target = warmed if row.variant.startswith(WARM_UP) else launched
        target.setdefault((row.arch, f"{dtype} {head_dim}", heads), set()).add(row.hash)
    problems = []
    for key, hashes in sorted(launched.items()):
        missing, extra = hashes - warmed.get(key, set()), warmed.get(key, set()) - hashes
        if missing or extra:
            problems.append(f"warm-up for sm_{key[0]} {key[1]} {key[2]}: {len(missing)} "
                            f"launched kernels not warmed, {len(extra)} warmed kernels no "
                            "batch launches")
    return problems


def kernel_table(rows: list[CompiledRow]) -> str:
    """One line per distinct kernel (arch, hash): its figures and the variants launching it."""
    groups: dict[tuple[int, str, str], list[CompiledRow]] = {}
    for row in rows:
        groups.setdefault((row.arch, row.hash or row.variant, row.kernel), []).append(row)
    header = (f"{'arch':<6}{'kernel':<15}{'dtype':<9}{'d':>4} {'regs':>5}{'spill st':>9}"
              f"{'spill ld':>9}{'stack':>7}{'shared':>8}{'warps':>6}{'stages':>7}  variants")
    lines = [header, "-" * len(header)]
    for (arch, _, kernel), group in sorted(groups.items(), key=lambda g: _sort_key(g[1][0])):
        first = group[0]
        head_dim = first.variant.split()[3].lstrip("d")
        names = _compact_variants([r.variant for r in group])
        flag = "  FAIL: " + "; ".join(first.problems) if first.problems else ""
        lines.append(
            f"sm_{arch:<3}{kernel:<15}{first.dtype:<9}{head_dim:>4} {first.registers:>5}"
            f"{first.spill_stores:>9}{first.spill_loads:>9}{first.stack_bytes:>7}"
            f"{first.shared_bytes:>8}{first.num_warps:>6}{first.num_stages:>7}  {names}{flag}")
    return "\n".join(lines)


def _sort_key(row: CompiledRow) -> tuple[object, ...]:
    parts = row.variant.split()
    return (row.arch, row.kernel, DTYPES.index(row.dtype), int(parts[3][1:]), row.variant)


def _compact_variants(labels: list[str]) -> str:
    """'extend causal bfloat16 d64 p1 GQA', '... p16 MHA' -> 'causal p1,16 GQA,MHA'."""
    by_scenario: dict[str, tuple[set[str], set[str]]] = {}
    for label in labels:
        kind, scenario, _, _, page, heads = label.split()
        name = WARM_UP if kind == WARM_UP else scenario
        pages, head_kinds = by_scenario.setdefault(name, (set(), set()))
        if kind != WARM_UP:
            pages.add(page[1:])
        head_kinds.add(heads)
    return " | ".join(
        f"{name}{' p' + ','.join(sorted(pages, key=int)) if pages else ''} "
        f"{','.join(sorted(kinds))}"
        for name, (pages, kinds) in by_scenario.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=ARCHS,
                        help="compute capability to compile for (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=min(len(ARCHS), os.cpu_count() or 1),
                        help="compiler processes (one architecture each)")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--quant-only", action="store_true",
                        help="only the dequantize-matmul kernels (no attention variants)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes"):
        print("the CUDA compile check compiles the kernels: unset TRITON_INTERPRET",
              file=sys.stderr)
        return 1
    why_not = ptxas_usable()
    if why_not is not None:
        print(f"Triton's CUDA toolchain cannot run here: {why_not}", file=sys.stderr)
        return 2
    archs = args.arch or list(ARCHS)
    variants = [] if args.quant_only else all_variants()
    begin = time.perf_counter()
    if args.jobs > 1 and len(archs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(archs)), mp_context=get_context("spawn")) as pool:
            results = list(pool.map(compile_arch, archs, [variants] * len(archs)))
    else:
        results = [compile_arch(arch, variants) for arch in archs]
    rows = [row for result in results for row in result]
    judge(rows)
    warm_up_problems = judge_warm_up(rows)
    print(kernel_table(rows))
    failed = [row for row in rows if row.problems]
    kernels = {(row.arch, row.hash) for row in rows if row.hash}
    compiled_s = sum(row.compile_s for row in rows)
    count = len(variants) + len(quant_variants())
    print(f"\n{count} variants x {len(archs)} architectures -> {len(rows)} launches, "
          f"{len(kernels)} distinct kernels; {len(failed)} over budget or failing; "
          f"{time.perf_counter() - begin:.0f} s wall ({compiled_s:.0f} s compiling)")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows]))
    print("engine-start warm-up: compiles exactly the kernels of every model shape above"
          if not warm_up_problems else "engine-start warm-up: MISMATCH")
    for row in failed:
        print(f"FAIL sm_{row.arch} {row.kernel} [{row.variant}]: {'; '.join(row.problems)}",
              file=sys.stderr)
    for problem in warm_up_problems:
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if failed or warm_up_problems else 0


if __name__ == "__main__":
    sys.exit(main())
