"""Filling a CausalLM from tensors named as in HF checkpoints.

HF stores q/k/v and gate/up as separate matrices; our model fuses each group into one
projection. `weight_plan` lists every HF tensor the architecture needs and the rows of which
fused parameter it fills; `load_weights` copies a stream of (name, tensor) pairs into place
and refuses a mis-shaped, missing or unexpected tensor with one error naming the source.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.llama import CausalLM
from plugserve.model.quant_install import QuantParts, install_quantized, quant_shape
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.reference import Activations

# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_LISTED = 8


@dataclass(frozen=True)
class WeightTarget:
    param: str  # our parameter's name
    row_start: int  # first row of that parameter this tensor fills
    rows: int | None  # rows it fills; None = the whole parameter


def _attention_plan(arch: ModelArchConfig, hf: str, ours: str) -> dict[str, WeightTarget]:
    q, kv = arch.q_size, arch.kv_size
    plan: dict[str, WeightTarget] = {}
    kinds = ["weight", "bias"] if arch.attention_bias else ["weight"]
    for kind in kinds:
        plan[f"{hf}.q_proj.{kind}"] = WeightTarget(f"{ours}.qkv_proj.{kind}", 0, q)
        plan[f"{hf}.k_proj.{kind}"] = WeightTarget(f"{ours}.qkv_proj.{kind}", q, kv)
        plan[f"{hf}.v_proj.{kind}"] = WeightTarget(f"{ours}.qkv_proj.{kind}", q + kv, kv)
    plan[f"{hf}.o_proj.weight"] = WeightTarget(f"{ours}.o_proj.weight", 0, None)
    if arch.attention_out_bias:
        plan[f"{hf}.o_proj.bias"] = WeightTarget(f"{ours}.o_proj.bias", 0, None)
    if arch.qk_norm:
        plan[f"{hf}.q_norm.weight"] = WeightTarget(f"{ours}.q_norm.weight", 0, None)
        plan[f"{hf}.k_norm.weight"] = WeightTarget(f"{ours}.k_norm.weight", 0, None)
    return plan


def _mlp_plan(arch: ModelArchConfig, hf: str, ours: str) -> dict[str, WeightTarget]:
    width = arch.intermediate_size
    plan: dict[str, WeightTarget] = {}
    for kind in ["weight", "bias"] if arch.mlp_bias else ["weight"]:
        plan[f"{hf}.gate_proj.{kind}"] = WeightTarget(f"{ours}.gate_up_proj.{kind}", 0, width)
        plan[f"{hf}.up_proj.{kind}"] = WeightTarget(f"{ours}.gate_up_proj.{kind}", width, width)
        plan[f"{hf}.down_proj.{kind}"] = WeightTarget(f"{ours}.down_proj.{kind}", 0, None)
    return plan


def weight_plan(arch: ModelArchConfig) -> dict[str, WeightTarget]:
    """HF tensor name -> where it goes, for every tensor `arch` requires."""
    plan = {"model.embed_tokens.weight": WeightTarget("embed_tokens.weight", 0, None)}
    for i in range(arch.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch.sandwich_norms:  # Gemma 3; our modules carry HF's names
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            plan[f"{hf}.{norm}.weight"] = WeightTarget(f"{ours}.{norm}.weight", 0, None)
        plan.update(_attention_plan(arch, f"{hf}.self_attn", f"{ours}.self_attn"))
        plan.update(_mlp_plan(arch, f"{hf}.mlp", f"{ours}.mlp"))
    plan["model.norm.weight"] = WeightTarget("final_norm.weight", 0, None)
    if not arch.tie_word_embeddings:
        plan["lm_head.weight"] = WeightTarget("lm_head.weight", 0, None)
    return plan


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def is_ignored(name: str, arch: ModelArchConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # A tied checkpoint may still store the (identical) LM head.
    return arch.tie_word_embeddings and name == "lm_head.weight"


def _raise_if_incomplete(missing: set[str], unexpected: set[str], source: str) -> None:
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {_listed(missing)}")
    if unexpected:
        problems.append(
            f"unexpected tensor(s) {_listed(unexpected)} (does the config match the weights?)"
        )
    if problems:
        raise ModelLoadError(f"{source}: " + "; ".join(problems))


def check_tensor_names(names: Iterable[str], arch: ModelArchConfig, source: str) -> None:
    """Fail fast, before reading any data, when the names do not match the architecture."""
    plan = weight_plan(arch)
    present = set(names)
    unexpected = {n for n in present - set(plan) if not is_ignored(n, arch)}
    _raise_if_incomplete(set(plan) - present, unexpected, source)


def load_weights(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantBlocks]], source: str,
    activations: Activations = "int8",
) -> None:
    """Copy every (HF name, tensor) into `model`; afterwards every parameter must be filled.
    Quantized tensors (`QuantBlocks`) are held as they are (`install_quantized`)."""
    plan = weight_plan(model.arch)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected: set[str] = set()
    pending = QuantParts()
    with torch.no_grad():
        for name, tensor in tensors:
            target = plan.get(name)
            if target is None:
                if not is_ignored(name, model.arch):
                    unexpected.add(name)
                continue
            param = params[target.param]
            rows = param.shape[0] if target.rows is None else target.rows
            expected = (rows, *param.shape[1:])
            shape = quant_shape(tensor)
            if shape != expected:
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {shape}, but the config "
                    f"needs {expected}"
                )
            if isinstance(tensor, QuantBlocks):
                pending.add(target.param, target.row_start, tensor)
            else:
                param[target.row_start : target.row_start + rows].copy_(tensor)
            seen.add(name)
    _raise_if_incomplete(set(plan) - seen, unexpected, source)
    install_quantized(model, pending, activations)
    model.requires_grad_(False)
    model.eval()
