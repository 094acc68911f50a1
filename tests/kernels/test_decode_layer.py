"""The compiled decoder-layer halves against the op-by-op path (bit for bit) and against
torch in float64, and a model's decode steps with and without them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plugserve.kernels import decode_layer as dl
from plugserve.kernels import skinny_linear as sk
from plugserve.kernels.fused_elementwise import rms_norm_reference
from plugserve.kernels.paged_decode import PagedDecodePlan
from plugserve.model import load_model
from plugserve.model.rope import apply_rope
from tests.model.conftest import PagedRunner, random_prompts, tiny_hf_model

pytestmark = pytest.mark.usefixtures("kernel_isa")  # once per ISA copy (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not dl.available():
        pytest.skip(f"decode_layer kernel unavailable: {dl.why_unavailable()}")


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if sk.takes_bf16() else [torch.float32]


# (hidden, heads, kv heads, head_dim, intermediate): a tiny shape with partial vectors and the
# default model's.
SHAPES = [(40, 4, 2, 10, 56), (576, 9, 3, 64, 1536)]
EPS = 1e-5


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _layer(shape: tuple[int, ...], bias: bool, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator().manual_seed(seed)
    qkv_out = (heads + 2 * kv_heads) * head_dim
    w = hidden**-0.5
    params: dict[str, Any] = {
        "input_norm": 1 + _randn(gen, hidden, scale=0.1),
        "qkv_w": _randn(gen, qkv_out, hidden, scale=w),
        "qkv_b": _randn(gen, qkv_out, scale=0.1) if bias else None,
        "o_w": _randn(gen, hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
        "o_b": _randn(gen, hidden, scale=0.1) if bias else None,
        "post_norm": 1 + _randn(gen, hidden, scale=0.1),
        "gate_up_w": _randn(gen, 2 * inter, hidden, scale=w),
        "gate_up_b": _randn(gen, 2 * inter, scale=0.1) if bias else None,
        "down_w": _randn(gen, hidden, inter, scale=inter**-0.5),
        "down_b": _randn(gen, hidden, scale=0.1) if bias else None,
    }
    return {k: None if v is None else v.to(dtype) for k, v in params.items()}


def _stack(shapes: list[tuple[int, ...]], dtype: torch.dtype, post_eps: float) -> dl.DecodeStack:
    """A stack of one layer per shape (seeded 0, 1, ...; layer 1 with biases)."""
    layers = []
    for seed, shape in enumerate(shapes):
        _, heads, kv_heads, head_dim, _ = shape
        p = _layer(shape, seed == 1, dtype, seed)
        layers.append(dl.LayerWeights(
            p["input_norm"], EPS, p["qkv_w"], p["qkv_b"], heads, kv_heads, head_dim, p["o_w"],
            p["o_b"], p["post_norm"], post_eps, p["gate_up_w"], p["gate_up_b"], p["down_w"],
            p["down_b"],
        ))
    return dl.DecodeStack(layers)


def _rows(shape: tuple[int, ...], rows: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    hidden, heads, _, head_dim, _ = shape
    gen = torch.Generator().manual_seed(seed + 1)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    return {
        "hidden": _randn(gen, rows, hidden).to(dtype),
        "attn": _randn(gen, rows, heads * head_dim).to(dtype),
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
    }


def _input_args(shape: tuple[int, ...], p: dict[str, Any], r: dict[str, Any]) -> tuple[Any, ...]:
    _, heads, kv_heads, head_dim, _ = shape
    return (r["hidden"], p["input_norm"], EPS, p["qkv_w"], p["qkv_b"], r["cos"], r["sin"],
            heads + kv_heads, head_dim)


def _output_args(p: dict[str, Any], r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["attn"], p["o_w"], p["o_b"], r["hidden"], p["post_norm"], EPS, p["gate_up_w"],
            p["gate_up_b"], p["down_w"], p["down_b"])


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_same_bits_as_the_op_by_op_path(
    dtype: torch.dtype, shape: tuple[int, ...], rows: int, bias: bool
) -> None:
    p, r = _layer(shape, bias, dtype, seed=rows), _rows(shape, rows, dtype, seed=rows)
    qkv = dl.attention_input(*_input_args(shape, p, r))
    assert qkv.dtype == dtype and qkv.shape == (rows, p["qkv_w"].shape[0])
    assert torch.equal(qkv, dl.attention_input_reference(*_input_args(shape, p, r)))
    out = dl.attention_output_and_mlp(*_output_args(p, r))
    assert out.dtype == dtype and out.shape == r["hidden"].shape
    assert torch.equal(out, dl.attention_output_and_mlp_reference(*_output_args(p, r)))


def _plan(shape: tuple[int, ...], rows: int, dtype: torch.dtype, window: bool) -> PagedDecodePlan:
    """A cache of 64 slots holding random KV; row i reads 5 + 3 i scattered slots, the last
    of them its new token's (`store_slots[i]`)."""
    _, _, kv_heads, head_dim, _ = shape
    gen = torch.Generator().manual_seed(rows)
    k_buffer = torch.randn(64, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(64, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([5 + 3 * i for i in range(rows)], dtype=torch.int64)
    slots = torch.zeros(rows, int(lens.max()), dtype=torch.int64)
    order = torch.randperm(64, generator=gen)
    start = 0
    for i, n in enumerate(lens.tolist()):  # rows do not share slots (55 of 64 at 5 rows)
        slots[i, :n] = order[start : start + n]
        start += n
    store_slots = slots[torch.arange(rows), lens - 1].clone()
    first_key = (lens - 4).clamp(min=0) if window else torch.zeros_like(lens)
    return PagedDecodePlan(k_buffer, v_buffer, store_slots, slots, first_key, lens, 0.3)


def _copy(plan: PagedDecodePlan) -> PagedDecodePlan:
    return dataclasses.replace(plan, k_buffer=plan.k_buffer.clone(), v_buffer=plan.v_buffer.clone())


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("window", [False, True])
def test_decode_step_same_bits_as_the_backend_path(
    dtype: torch.dtype, shape: tuple[int, ...], rows: int, window: bool
) -> None:
    _, heads, kv_heads, head_dim, _ = shape
    p, r = _layer(shape, True, dtype, seed=rows), _rows(shape, rows, dtype, seed=rows)
    plan = _plan(shape, rows, dtype, window)
    ref_plan = _copy(plan)

    def args(plan: PagedDecodePlan) -> tuple[Any, ...]:
        return (r["hidden"], p["input_norm"], EPS, p["qkv_w"], p["qkv_b"], r["cos"], r["sin"],
                heads, kv_heads, head_dim, plan, p["o_w"], p["o_b"], p["post_norm"], EPS,
                p["gate_up_w"], p["gate_up_b"], p["down_w"], p["down_b"])

    before = plan.k_buffer.clone()
    out = dl.decode_step(*args(plan))
    ref = dl.decode_step_reference(*args(ref_plan))
    assert out.dtype == dtype and torch.equal(out, ref)
    # the new k and v went to the store slots and nowhere else
    assert torch.equal(plan.k_buffer, ref_plan.k_buffer)
    assert torch.equal(plan.v_buffer, ref_plan.v_buffer)
    changed = (plan.k_buffer != before).flatten(1).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(plan.store_slots.tolist())


def test_decode_step_refuses_a_bad_cache_or_slot() -> None:
    shape = SHAPES[0]
    _, heads, kv_heads, head_dim, _ = shape
    p, r = _layer(shape, False, torch.float32, 1), _rows(shape, 1, torch.float32, 1)

    def step(plan: PagedDecodePlan) -> torch.Tensor:
        return dl.decode_step(r["hidden"], p["input_norm"], EPS, p["qkv_w"], None, r["cos"],
                              r["sin"], heads, kv_heads, head_dim, plan, p["o_w"], None,
                              p["post_norm"], EPS, p["gate_up_w"], None, p["down_w"], None)

    with pytest.raises(RuntimeError, match="the KV cache holds Double"):
        step(_plan(shape, 1, torch.float64, False))
    plan = _plan(shape, 1, torch.float32, False)
    before = plan.k_buffer.clone()
    with pytest.raises(RuntimeError, match="store slot 64 is outside the cache's 64 slots"):
        step(dataclasses.replace(plan, store_slots=torch.tensor([64])))
    assert torch.equal(plan.k_buffer, before)  # nothing written


def _torch_input(shape: tuple[int, ...], p: dict[str, Any], r: dict[str, Any]) -> torch.Tensor:
    """attention_input in plain torch: the norm reference, float64 linear, HF's rope."""
    _, heads, kv_heads, head_dim, _ = shape
    normed = rms_norm_reference(r["hidden"], p["input_norm"], EPS)
    b = None if p["qkv_b"] is None else p["qkv_b"].double()
    qkv = F.linear(normed.double(), p["qkv_w"].double(), b).float()
    width = (heads + kv_heads) * head_dim
    cos, sin = r["cos"][:, None], r["sin"][:, None]  # [rows, 1, half]: over every head
    qk = apply_rope(qkv[:, :width].view(-1, heads + kv_heads, head_dim), cos, sin)
    return torch.cat([qk.reshape(-1, width), qkv[:, width:]], dim=1)


def _torch_output(p: dict[str, Any], r: dict[str, Any]) -> torch.Tensor:
    def lin(x: torch.Tensor, w: str, b: str) -> torch.Tensor:
        bias = None if p[b] is None else p[b].double()
        return F.linear(x.double(), p[w].double(), bias)

    h = r["hidden"].double() + lin(r["attn"], "o_w", "o_b")
    x = rms_norm_reference(h.float(), p["post_norm"], EPS)
    gate, up = lin(x, "gate_up_w", "gate_up_b").chunk(2, dim=-1)
    return (h + lin(F.silu(gate) * up, "down_w", "down_b")).float()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_torch_in_float64(shape: tuple[int, ...], bias: bool) -> None:
    p, r = _layer(shape, bias, torch.float32, seed=7), _rows(shape, 3, torch.float32, seed=7)
    qkv = dl.attention_input(*_input_args(shape, p, r))
    torch.testing.assert_close(qkv, _torch_input(shape, p, r), rtol=1e-5, atol=1e-5)
    out = dl.attention_output_and_mlp(*_output_args(p, r))
    torch.testing.assert_close(out, _torch_output(p, r), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_the_shapes() -> None:
    shape = SHAPES[0]
    p, r = _layer(shape, False, torch.float32, 1), _rows(shape, 2, torch.float32, 1)
    args = list(_input_args(shape, p, r))
    args[3] = p["qkv_w"][:, :-1]  # one input column short
    with pytest.raises(RuntimeError, match="the weight must be \\[outputs, 40\\]"):
        dl.attention_input(*args)
    args = list(_input_args(shape, p, r))
    args[5] = r["cos"][:1]  # angles for one row of two
    with pytest.raises(RuntimeError, match="cos and sin must hold 5 contiguous"):
        dl.attention_input(*args)
    args = list(_input_args(shape, p, r))
    args[7] = 100  # more rotated heads than the projection has
    with pytest.raises(RuntimeError, match="do not fit"):
        dl.attention_input(*args)
    out_args = list(_output_args(p, r))
    out_args[3] = r["hidden"][:1]  # a residual of one row for two
    with pytest.raises(RuntimeError, match="the residual must be"):
        dl.attention_output_and_mlp(*out_args)
    out_args = list(_output_args(p, r))
    out_args[6] = p["gate_up_w"][1:]  # an odd number of gate | up outputs
    with pytest.raises(RuntimeError, match="even number"):
        dl.attention_output_and_mlp(*out_args)


def _model_logits(model: Any, prompts: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """Logits of a prefill and `steps` greedy decode steps through the paged test runner."""
    runner = PagedRunner(model, len(prompts), page_size=4)
    out = runner.prefill(prompts, last_only=True)
    logits = [out.logits]
    for _ in range(steps):
        out = runner.decode(out.logits.argmax(-1).tolist())
        logits.append(out.logits)
    return logits


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("kind", ["llama", "llama3_rope_bias"])
def test_model_decode_steps_equal_without_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kind: str
) -> None:
    """A tiny model's prefill and decode logits, with the layers' compiled path and without
    it, are the same bits; and every decode step runs the whole stack in one call, with the
    slot operands torch_native shares between its full layers passed once (run_shared)."""
    tiny_hf_model(kind, tmp_path)
    model = load_model(str(tmp_path), dtype=dtype, device="cpu").model
    prompts = random_prompts([3, 2] if dtype == torch.float32 else [4], seed=5)
    runs = 0
    real_run = dl.DecodeStack.run

    def counting(self: dl.DecodeStack, *args: Any) -> torch.Tensor:
        nonlocal runs
        runs += 1
        return real_run(self, *args)

    monkeypatch.setattr(dl.DecodeStack, "run", counting)
    shared = 0
    real_set_kv = dl.DecodeStack._set_kv

    def counting_shared(self: dl.DecodeStack, plans: Any) -> None:
        nonlocal shared
        shared += 1
        real_set_kv(self, plans)

    monkeypatch.setattr(dl.DecodeStack, "_set_kv", counting_shared)
    with_kernel = _model_logits(model, prompts)
    assert runs == 3 and shared == 3  # every decode step, all layers in one call
    monkeypatch.setattr(dl, "applies", lambda *args: False)
    without = _model_logits(model, prompts)
    assert runs == 3
    for ours, ref in zip(with_kernel, without, strict=True):
        assert torch.equal(ours, ref)


def test_model_runs_layers_one_by_one_where_a_plan_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the backend plans some layers' attention and not others, each layer takes its
    own path (one call with a plan, two around `forward` without), with the same logits, and
    no layer's plan is asked for twice."""
    tiny_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    prompts = random_prompts([3, 2], seed=6)
    reference = _model_logits(model, prompts)
    from plugserve.attention.torch_native import TorchNativeBackend

    real_plan = TorchNativeBackend.paged_decode_plan
    asked: list[int] = []

    def first_layer_only(self: Any, layer: Any, fb: Any) -> PagedDecodePlan | None:
        asked.append(layer.layer_id)
        return real_plan(self, layer, fb) if layer.layer_id == 0 else None

    monkeypatch.setattr(TorchNativeBackend, "paged_decode_plan", first_layer_only)
    steps = []
    real_step = dl.decode_step
    monkeypatch.setattr(dl, "decode_step", lambda *a: steps.append(1) or real_step(*a))
    mixed = _model_logits(model, prompts)
    layers = model.arch.num_hidden_layers
    # once per layer and forward (the prefill's few rows ask too; it gets none), and layer 0
    # took one call in each decode step
    assert asked == list(range(layers)) * 4 and len(steps) == 3
    for ours, ref in zip(mixed, reference, strict=True):
        assert torch.equal(ours, ref)


def test_stack_equals_the_layers_one_by_one_and_refuses_missing_plans() -> None:
    """`DecodeStack.run` is each layer's `decode_step` in turn, bit for bit (its reference
    path, over copies of the caches); a plan list of the wrong length is refused."""
    shape, dtype = SHAPES[1], _dtypes()[-1]
    stack = _stack([shape] * 3, dtype, post_eps=EPS * 2)
    r = _rows(shape, 2, dtype, seed=3)
    plans = [_plan(shape, 2, dtype, window=i == 2) for i in range(3)]
    _assert_run_equals_reference(stack, r, plans)
    with pytest.raises(RuntimeError, match=r"one plan per layer is needed \(3 layers\), got 2"):
        stack.run(r["hidden"], r["cos"], r["sin"], plans[:2])


@pytest.mark.parametrize("window", [False, True])
def test_stack_with_shared_slots_holds_the_buffers_and_equals_the_layers(
    monkeypatch: pytest.MonkeyPatch, window: bool
) -> None:
    """Plans that share their slot operands (a model without windowed layers) run through
    `run_shared` with the buffers and scales held by the stack (handed again only when one
    moves), bit for bit the layers one by one; the compiled call refuses to run before the
    buffers are set."""
    shape, dtype = SHAPES[1], _dtypes()[-1]
    stack = _stack([shape] * 3, dtype, post_eps=EPS * 2)
    with pytest.raises(RuntimeError, match=r"KV buffers of the 3 layers are needed first"):
        plan, r = _plan(shape, 2, dtype, window), _rows(shape, 2, dtype, seed=3)
        stack._stack.run_shared(r["hidden"], r["cos"], r["sin"], plan.store_slots, plan.slots,
                                plan.first_key, plan.kv_lens, False)
    handed: list[str] = []
    monkeypatch.setattr(stack, "_stack", _Recording(stack._stack, handed))

    def layer_plans(seed: int) -> list[PagedDecodePlan]:
        """One cache per layer (its own scale), the same slot operands for all."""
        base = _plan(shape, 2, dtype, window)
        torch.manual_seed(seed)
        return [dataclasses.replace(base, k_buffer=base.k_buffer + torch.randn(()),
                                    v_buffer=base.v_buffer - i, scale=0.3 + 0.1 * i)
                for i in range(3)]

    first = layer_plans(0)
    for step, plans in enumerate([first, first, layer_plans(1)]):
        _assert_run_equals_reference(stack, _rows(shape, 2, dtype, seed=3 + step), plans)
    assert handed == ["set_kv", "run_shared", "run_shared", "set_kv", "run_shared"]


@pytest.mark.parametrize("rows", [1, 3])
def test_stack_of_layers_of_different_shapes_equals_the_layers(rows: int) -> None:
    """The buffers a stack call reuses are shaped after its first layer; a layer of another
    width (heads, MLP) gets its own, with the same bits as the layers one by one."""
    shapes = [(40, 4, 2, 10, 56), (40, 2, 1, 10, 24), (40, 4, 2, 10, 56), (40, 6, 3, 10, 56)]
    dtype = _dtypes()[-1]
    stack = _stack(shapes, dtype, post_eps=EPS)
    r = _rows(shapes[0], rows, dtype, seed=4)
    plans = [_plan(shape, rows, dtype, window=False) for shape in shapes]
    ref_plans = [_copy(plan) for plan in plans]
    out = stack.run(r["hidden"], r["cos"], r["sin"], plans)
    assert torch.equal(out, stack.run_reference(r["hidden"], r["cos"], r["sin"], ref_plans))
    again = stack.run(r["hidden"], r["cos"], r["sin"], [_copy(plan) for plan in ref_plans])
    assert torch.equal(again, out) and again.data_ptr() != out.data_ptr()  # a new result


def _assert_run_equals_reference(
    stack: dl.DecodeStack, r: dict[str, Any], plans: list[PagedDecodePlan]
) -> None:
    """`stack.run` over `plans` gives the bits of its layer-by-layer reference over copies of
    the plans, the caches it wrote included."""
    ref_plans = [_copy(plan) for plan in plans]
    out = stack.run(r["hidden"], r["cos"], r["sin"], plans)
    assert torch.equal(out, stack.run_reference(r["hidden"], r["cos"], r["sin"], ref_plans))
    for plan, ref_plan in zip(plans, ref_plans, strict=True):
        assert torch.equal(plan.k_buffer, ref_plan.k_buffer)
        assert torch.equal(plan.v_buffer, ref_plan.v_buffer)


class _Recording:
    """The compiled stack, recording which of its methods are called."""

    def __init__(self, stack: Any, calls: list[str]) -> None:
        self._stack, self._calls = stack, calls

    def __getattr__(self, name: str) -> Any:
        self._calls.append(name)
        return getattr(self._stack, name)


def test_stack_sees_weight_writes_and_is_rebuilt_for_a_new_parameter(tmp_path: Path) -> None:
    """The model's stack shares the parameters' storage (an in-place write changes its
    output) and is built again once a parameter object is replaced."""
    tiny_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu").model
    prompts = random_prompts([3], seed=7)
    before = _model_logits(model, prompts, steps=1)
    stack = model._decode_stack()
    down = model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.mul_(2)
    doubled = _model_logits(model, prompts, steps=1)
    assert model._decode_stack() is stack
    assert not torch.equal(doubled[1], before[1])
    halved = down.weight.detach() / 2
    down.weight = torch.nn.Parameter(halved, requires_grad=False)
    assert model._decode_stack() is not stack
    assert all(torch.equal(a, b) for a, b in zip(_model_logits(model, prompts, steps=1), before,
                                                 strict=True))
