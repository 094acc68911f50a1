"""The CUDA compile check (`cuda_compile_check.py`) in the test suite, and its judgement.

The check compiles, for sm_80 and sm_90 and without a GPU, what every variant's launches
compile (Triton's own launch binder, Triton's bundled ptxas) and fails on a compiler error, on
register spills, on shared memory over the architecture's limit and on an engine-start
warm-up that does not compile exactly the kernels real batches launch. It runs in a process of
its own because this one decorated the kernels for the CPU interpreter. Its table of registers,
spills and shared memory per kernel is printed to the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import cuda_compile_check as check
import cuda_compile_toolchain as toolchain

SCRIPT = Path(check.__file__)


def test_every_variant_compiles_for_cuda_within_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows_path = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--json", str(rows_path)], env=env,
                            capture_output=True, text=True, timeout=1200)
    if result.returncode == 2:
        pytest.skip(result.stderr.strip()[-500:])
    with capsys.disabled():
        print("\n" + result.stdout)
    assert result.returncode == 0, result.stderr[-6000:]
    rows = json.loads(rows_path.read_text())
    compiled = {(row["arch"], row["variant"]) for row in rows if row["hash"]}
    expected = {(arch, variant.label) for arch in check.ARCHS
                for variant in [*check.all_variants(), *check.quant_variants()]}
    assert expected <= compiled, f"variants without a kernel: {sorted(expected - compiled)[:5]}"


def test_variants_cover_the_matrix() -> None:
    variants = check.all_variants()
    for attribute, values in (("dtype", check.DTYPES), ("head_dim", check.HEAD_DIMS),
                              ("page_size", check.PAGE_SIZES), ("heads", tuple(check.HEADS))):
        assert {getattr(v, attribute) for v in variants} == set(values)
    scenarios = {v.scenario for v in variants}
    assert {"window", "tree", "tree+window", "split8", "topk4"} <= scenarios
    assert len({v.label for v in variants}) == len(variants)


def test_quant_variants_cover_every_type_dtype_and_row_regime() -> None:
    variants = check.quant_variants()
    assert {v.qtype for v in variants} == {"q8_0", "q4_k", "q6_k"}
    assert {v.dtype for v in variants} == set(check.DTYPES)
    assert min(v.rows for v in variants) <= 16 < max(v.rows for v in variants)
    assert all(len(v.label.split()) == 6 for v in variants)


def _row(**fields: object) -> check.CompiledRow:
    base: dict[str, object] = dict(arch=80, variant="extend causal bfloat16 d128 p1 GQA",
                                   kernel="extend", dtype="bfloat16", hash="h1", registers=200,
                                   spill_stores=0, spill_loads=0, stack_bytes=0,
                                   shared_bytes=50_000)
    base.update(fields)
    return check.CompiledRow(**base)  # type: ignore[arg-type]


def test_judge_fails_spills_shared_memory_and_compiler_errors() -> None:
    rows = [_row(), _row(spill_stores=8), _row(arch=80, shared_bytes=170_000),
            _row(arch=90, shared_bytes=170_000), _row(error="PTXASError: boom"),
            _row(dtype="float32", spill_stores=4)]
    check.judge(rows)
    assert [bool(r.problems) for r in rows] == [False, True, True, False, True, True]
    assert "8 bytes of spill stores (budget 0)" in rows[1].problems[0]
    assert "sm_80 allows 166912" in rows[2].problems[0]
    assert "compile error: PTXASError" in rows[4].problems[0]


def test_judge_warm_up_wants_exactly_the_launched_kernels() -> None:
    launched = [_row(hash="a"), _row(hash="b", variant="extend tree bfloat16 d128 p16 GQA")]
    warm = "warm-up start bfloat16 d128 p0 GQA"
    assert check.judge_warm_up([*launched, _row(hash="a", variant=warm),
                                _row(hash="b", variant=warm)]) == []
    missing = check.judge_warm_up([*launched, _row(hash="a", variant=warm)])
    assert missing and "1 launched kernels not warmed" in missing[0]
    extra = check.judge_warm_up([*launched, _row(hash="a", variant=warm),
                                 _row(hash="b", variant=warm), _row(hash="c", variant=warm)])
    assert extra and "1 warmed kernels no batch launches" in extra[0]


def test_ptxas_report_is_parsed() -> None:
    log = ("ptxas info    : Compiling entry function '_extend_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for _extend_kernel\n"
           "    8320 bytes stack frame, 16388 bytes spill stores, 19276 bytes spill loads\n"
           "ptxas info    : Used 32 registers, used 1 barriers, 8320 bytes cumulative stack\n")
    assert toolchain._parse_ptxas(log) == {"registers": 32, "spill_stores": 16388,
                                       "spill_loads": 19276, "stack_bytes": 8320}
    assert toolchain._parse_ptxas("ptxas info: nothing") is None


def _compiled_kernel_count() -> int:
    from plugserve_attention_triton.kernels import decode, extend

    return sum(len(caches[0]) for kernel in (extend._extend_kernel, decode._decode_partial_kernel,
                                             decode._decode_reduce_kernel)
               for caches in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backend_start_compiles_what_every_batch_launches(gpu_factory, dtype):
    """On a GPU: after the backend is built, prefill, windowed prefill, tree verify, decode,
    split decode, windowed decode and topk>1 draft decode compile nothing more."""
    import torch

    from plugserve.structs.forward_batch import ForwardMode

    torch_dtype = getattr(torch, dtype)
    shape = dict(page_size=16, num_kv_heads=2, head_dim=128, dtype=torch_dtype)
    batches = [
        (gpu_factory.extend_batch(prefix_lens=[0, 40], extend_lens=[100, 7], **shape), None),
        (gpu_factory.extend_batch(prefix_lens=[0, 40], extend_lens=[100, 7], **shape), 32),
        (gpu_factory.extend_batch(prefix_lens=[50], extend_lens=[8], tree_mask=True,
                                  mode=ForwardMode.TARGET_VERIFY, **shape), 32),
        (gpu_factory.decode_batch(seq_lens=[3, 90], **shape), None),
        (gpu_factory.decode_batch(seq_lens=[700, 3000], **shape), None),
        (gpu_factory.decode_batch(seq_lens=[700, 3000], **shape), 64),
        (gpu_factory.draft_decode_batch(prefix_lens=[30, 70], topk=4, step=1, num_steps=3,
                                        **shape)[0], None),
    ]
    layer = gpu_factory.layer(num_heads=8, num_kv_heads=2, head_dim=128)
    triton_backend, _ = gpu_factory.backends(layer, 16, torch_dtype)
    warmed = _compiled_kernel_count()
    assert warmed >= 8
    for fb, window in batches:
        windowed = gpu_factory.layer(num_heads=8, num_kv_heads=2, head_dim=128,
                                     sliding_window=window)
        q = gpu_factory.randn(fb.num_tokens, 8, 128, dtype=torch_dtype)
        triton_backend.init_forward_metadata(fb)
        if fb.mode.is_decode():
            triton_backend.forward_decode(q, windowed, fb)
        else:
            triton_backend.forward_extend(q, windowed, fb)
    torch.cuda.synchronize()
    assert _compiled_kernel_count() == warmed
