"""Loading one tensor-parallel rank's shard: each rank reads only its slice of every weight.

From safetensors a rank reads `safe_open(...).get_slice(name)[rows]` (or `[:, cols]`), never
the whole tensor (quantized after slicing with `quantization` q8_0 / q4_0 / q4_k). From a GGUF
file it slices the raw blocks: whole rows always split (column-parallel weights), but a
row-parallel weight is split inside its rows, which a quantized type can only do at its
block boundaries; a shape that does not split there is refused with the reason
(`gguf_slice_problem`, `on_load_slice_problem`). Kept types stay quantized as on one rank.

`shard_plan` says, for every HF tensor name, which slice this rank takes and where it goes.
Names are checked against the architecture before any data is read, exactly as for one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from plugserve.model.arch import ModelArchConfig
from plugserve.model.errors import ModelLoadError
from plugserve.model.loaded_model import LoadedModel
from plugserve.model.quant_install import QuantParts, install_quantized
from plugserve.model.quant_on_load import is_layer_matrix, quantized_stream, quantizes_on_load
from plugserve.model.tp_layers import TPCausalLM
from plugserve.model.tp_shard import ModelShard
from plugserve.model.weights import check_tensor_names
from plugserve.quant.blocks import QuantBlocks
from plugserve.quant.quantize import quantizable
from plugserve.quant.reference import Activations
from plugserve.quant.types import kept_type, quant_type


@dataclass(frozen=True)
class ShardTarget:
    """Where one HF tensor's slice goes: rows [row_start, row_start + stop - start) of our
    parameter `param` get source rows (dim 0) or columns (dim 1) [start, stop); dim None =
    the whole tensor, replicated on every rank. `full` is the source's size along `dim`."""

    param: str
    row_start: int = 0
    dim: int | None = None
    start: int = 0
    stop: int = 0
    full: int = 0


def _attention(arch: ModelArchConfig, s: ModelShard, hf: str, ours: str) -> dict[str, ShardTarget]:
    hd = arch.head_dim
    q_rows, kv_rows = s.heads * hd, s.kv_heads * hd
    q0, kv0 = s.first_head * hd, s.first_kv_head * hd
    qkv = f"{ours}.qkv_proj"
    plan: dict[str, ShardTarget] = {}
    for kind in ["weight", "bias"] if arch.attention_bias else ["weight"]:
        plan[f"{hf}.q_proj.{kind}"] = ShardTarget(f"{qkv}.{kind}", 0, 0, q0, q0 + q_rows,
                                                  arch.q_size)
        plan[f"{hf}.k_proj.{kind}"] = ShardTarget(f"{qkv}.{kind}", q_rows, 0, kv0,
                                                  kv0 + kv_rows, arch.kv_size)
        plan[f"{hf}.v_proj.{kind}"] = ShardTarget(f"{qkv}.{kind}", q_rows + kv_rows, 0, kv0,
                                                  kv0 + kv_rows, arch.kv_size)
    plan[f"{hf}.o_proj.weight"] = ShardTarget(f"{ours}.o_proj.weight", 0, 1, q0, q0 + q_rows,
                                              arch.q_size)
    if arch.attention_out_bias:
        plan[f"{hf}.o_proj.bias"] = ShardTarget(f"{ours}.o_proj.bias")
    if arch.qk_norm:
        plan[f"{hf}.q_norm.weight"] = ShardTarget(f"{ours}.q_norm.weight")
        plan[f"{hf}.k_norm.weight"] = ShardTarget(f"{ours}.k_norm.weight")
    return plan


def _mlp(arch: ModelArchConfig, s: ModelShard, hf: str, ours: str) -> dict[str, ShardTarget]:
    width, full = s.intermediate, arch.intermediate_size
    first = s.rank * width
    plan: dict[str, ShardTarget] = {}
    for kind in ["weight", "bias"] if arch.mlp_bias else ["weight"]:
        gate_up = f"{ours}.gate_up_proj.{kind}"
        plan[f"{hf}.gate_proj.{kind}"] = ShardTarget(gate_up, 0, 0, first, first + width, full)
        plan[f"{hf}.up_proj.{kind}"] = ShardTarget(gate_up, width, 0, first, first + width, full)
    plan[f"{hf}.down_proj.weight"] = ShardTarget(f"{ours}.down_proj.weight", 0, 1, first,
                                                 first + width, full)
    if arch.mlp_bias:
        plan[f"{hf}.down_proj.bias"] = ShardTarget(f"{ours}.down_proj.bias")
    return plan


def shard_plan(arch: ModelArchConfig, shard: ModelShard) -> dict[str, ShardTarget]:
    """HF tensor name -> this rank's slice of it and where it goes, for every tensor."""
    start, stop = shard.vocab_range
    vocab = ShardTarget("embed_tokens.weight", 0, 0, start, stop, arch.vocab_size)
    plan = {"model.embed_tokens.weight": vocab}
    for i in range(arch.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            plan[f"{hf}.{norm}.weight"] = ShardTarget(f"{ours}.{norm}.weight")
        plan.update(_attention(arch, shard, f"{hf}.self_attn", f"{ours}.self_attn"))
        plan.update(_mlp(arch, shard, f"{hf}.mlp", f"{ours}.mlp"))
    plan["model.norm.weight"] = ShardTarget("final_norm.weight")
    if not arch.tie_word_embeddings:
        plan["lm_head.weight"] = ShardTarget("lm_head.weight", 0, 0, start, stop,
                                             arch.vocab_size)
    return plan


def _fill(model: TPCausalLM, tensors: Iterator[tuple[str, torch.Tensor | QuantBlocks]],
          plan: dict[str, ShardTarget], activations: Activations) -> None:
    """Copy each slice (its source shape already checked) into place; quantized slices are
    held as blocks. The vocabulary's padding rows on the last rank stay zero."""
    params = dict(model.named_parameters())
    pending = QuantParts()
    with torch.no_grad():
        for param in (model.embed_tokens.weight, model.lm_head_weight):
            param.zero_()
        for name, tensor in tensors:
            target = plan[name]
            if isinstance(tensor, QuantBlocks):
                pending.add(target.param, target.row_start, tensor)
                continue
            rows = tensor.shape[0]
            params[target.param][target.row_start : target.row_start + rows].copy_(tensor)
    install_quantized(model, pending, activations)
    model.requires_grad_(False)
    model.eval()


def _check_full_shape(name: str, shape: tuple[int, ...], target: ShardTarget,
                      param: torch.Tensor, source: str) -> None:
    if target.dim is None:
        expected = tuple(param.shape)
    elif target.dim == 0:
        expected = (target.full, *param.shape[1:])
    else:
        expected = (param.shape[0], target.full)
    if shape != expected:
        raise ModelLoadError(f"{source}: tensor {name!r} has shape {shape}, but the config "
                             f"needs {expected}")


# --- safetensors --------------------------------------------------------------------------


def on_load_slice_problem(name: str, target: ShardTarget, cols: int, quantization: str,
                          tp_size: int) -> str | None:
    """Why this rank's columns of a matrix that `quantization` would quantize whole cannot be
    quantized (None when they can, or when the matrix stays dense on one rank too)."""
    qtype = quant_type(quantization)
    if target.dim != 1 or not quantizable(target.full, qtype):
        return None
    if quantizable(target.stop - target.start, qtype) and target.start % qtype.block_elems == 0:
        return None
    return (f"tensor {name!r} has {target.full} columns; split over tp size {tp_size} each "
            f"rank gets {cols}, not a multiple of the {qtype.block_elems}-weight "
            f"{qtype.name} block; use a tp size whose slices are whole blocks or another "
            "quantization")


def _quantized_slices(
    tensors: Iterator[tuple[str, torch.Tensor]], plan: dict[str, ShardTarget],
    quantization: str, tp_size: int, source: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The slices as they are, after refusing one that would quantize only part of a
    block."""
    for name, tensor in tensors:
        if is_layer_matrix(name, tensor):
            problem = on_load_slice_problem(name, plan[name], tensor.shape[1], quantization,
                                            tp_size)
            if problem is not None:
                raise ModelLoadError(f"{source}: {problem}")
        yield name, tensor


def _safetensors_slices(
    files: dict[str, Path], plan: dict[str, ShardTarget], params: dict[str, torch.Tensor],
    source: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name in plan:
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    target = plan[name]
                    part = f.get_slice(name)
                    shape = tuple(int(n) for n in part.get_shape())
                    _check_full_shape(name, shape, target, params[target.param], source)
                    if target.dim is None:
                        yield name, f.get_tensor(name)
                    elif target.dim == 0:
                        yield name, part[target.start : target.stop]
                    else:
                        yield name, part[:, target.start : target.stop]
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc


def load_hf_shard(path: str | Path, shard: ModelShard, *, dtype: torch.dtype,
                  device: torch.device | str, quantization: str | None = None,
                  quant_activations: Activations = "int8") -> LoadedModel:
    from plugserve.model.loader_hf import read_arch, weight_files
    from plugserve.model.tokenizer import Tokenizer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder does not exist (or is not a folder)")
    arch = read_arch(folder)
    files = weight_files(folder)
    check_tensor_names(files, arch, str(folder))
    model = TPCausalLM(arch, shard, dtype=dtype, device=device)
    plan = shard_plan(arch, shard)
    params = dict(model.named_parameters())
    dense = _safetensors_slices(files, plan, params, str(folder))
    slices: Iterator[tuple[str, torch.Tensor | QuantBlocks]] = dense
    if quantizes_on_load(quantization):
        assert quantization is not None
        checked = _quantized_slices(dense, plan, quantization, shard.size, str(folder))
        slices = quantized_stream(checked, quantization, str(folder))
    _fill(model, slices, plan, quant_activations)
    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=arch.eos_token_ids)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, source=folder,
                       shard_arch=model.local_arch)


# --- GGUF ---------------------------------------------------------------------------------


def gguf_slice_problem(name: str, tensor_type: Any, cols: int, start: int, stop: int,
                       tp_size: int = 0) -> str | None:
    """Why columns [start, stop) of a `cols`-wide GGUF tensor row cannot be cut out without
    splitting a quantization block (None when they can)."""
    block, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    if start % block == 0 and stop % block == 0:
        return None
    split = f" split over tp size {tp_size}" if tp_size else ""
    return (f"tensor {name!r} is stored as {tensor_type.name} in blocks of {block} values, "
            f"and{split} this rank's columns [{start}, {stop}) of its {cols} do not start "
            "and end on a block boundary; use a tensor-parallel size whose slices are whole "
            "blocks, or an unquantized (F32/F16/BF16) or safetensors model")


def _gguf_slice(t: Any, target: ShardTarget, source: str, tp_size: int,
                keep: bool) -> torch.Tensor | QuantBlocks:
    """This rank's slice of a GGUF tensor: its raw blocks for a kept type (when `keep`),
    else float32 in torch layout; only that slice of the raw data is read."""
    data = t.data
    if target.dim == 0:
        data = data[target.start : target.stop]
    elif target.dim == 1:
        cols = int(t.shape[0])  # GGUF's first dimension is the row length
        problem = gguf_slice_problem(t.name, t.tensor_type, cols, target.start, target.stop,
                                     tp_size)
        if problem is not None:
            raise ModelLoadError(f"{source}: {problem}")
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if data.dtype != np.uint8:  # unquantized: the reader gives values, not bytes
            data = data[:, target.start : target.stop]
        else:
            data = data[:, target.start // block * type_size : target.stop // block * type_size]
    qtype = kept_type(t.tensor_type)
    if keep and qtype is not None and data.ndim == 2:
        rows = data.shape[0]
        cols = data.shape[1] // qtype.block_bytes * qtype.block_elems
        raw = torch.from_numpy(np.ascontiguousarray(data))
        return QuantBlocks(qtype, raw, rows, cols)
    values = gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32))


def _gguf_slices(file: Any, arch: ModelArchConfig,
                 plan: dict[str, ShardTarget], params: dict[str, torch.Tensor],
                 source: str, tp_size: int, keep: bool,
                 ) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    from plugserve.model.gguf_blocks import is_quantized
    from plugserve.model.loader_gguf import (
        ROPE_FREQS,
        hf_name,
        undo_rope_permutation,
        warn_dequantized,
    )

    unpermute = file.metadata.get("general.architecture") == "llama"
    dequantized: dict[str, list[str]] = {}
    for t in file.reader.tensors:
        name = hf_name(t.name)
        if t.name == ROPE_FREQS or name not in plan:
            continue
        target = plan[name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        _check_full_shape(name, shape, target, params[target.param], source)
        if keep and is_quantized(t) and kept_type(t.tensor_type) is None:
            dequantized.setdefault(t.tensor_type.name, []).append(t.name)
        tensor = _gguf_slice(t, target, source, tp_size, keep)
        kind = t.name.split(".")[2:3]
        if unpermute and kind in (["attn_q"], ["attn_k"]):  # whole heads: undo per head
            if isinstance(tensor, QuantBlocks):
                heads = tensor.rows // arch.head_dim
                data = undo_rope_permutation(tensor.data, heads).contiguous()
                tensor = QuantBlocks(tensor.qtype, data, tensor.rows, tensor.cols)
            else:
                tensor = undo_rope_permutation(tensor, tensor.shape[0] // arch.head_dim)
        yield name, tensor
    warn_dequantized(file.path, dequantized)


def load_gguf_shard(path: str | Path, shard: ModelShard, *, dtype: torch.dtype,
                    device: torch.device | str, quantization: str | None = None,
                    quant_activations: Activations = "int8") -> LoadedModel:
    from plugserve.model.gguf_tokenizer import tokenizer_from_gguf
    from plugserve.model.loader_gguf import (
        ROPE_FREQS,
        hf_name,
        keeps_blocks,
        open_gguf,
        read_arch,
    )

    file = open_gguf(path)
    arch = read_arch(file)
    source = str(file.path)
    if quantization not in (None, "none"):
        raise ModelLoadError(
            f"{source}: quantization {quantization!r} applies to HF model folders; a GGUF file "
            "keeps the types it stores (or quantization 'none' dequantizes them)")
    check_tensor_names([hf_name(n) for n in file.tensor_names if n != ROPE_FREQS], arch, source)
    tokenizer = tokenizer_from_gguf(file.metadata, file.path)
    model = TPCausalLM(arch, shard, dtype=dtype, device=device)
    plan = shard_plan(arch, shard)
    params = dict(model.named_parameters())
    keep = keeps_blocks(quantization, device)
    _fill(model, _gguf_slices(file, arch, plan, params, source, shard.size, keep), plan,
          quant_activations)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, source=file.path,
                       shard_arch=model.local_arch)


def model_arch(path: str | Path | None) -> ModelArchConfig:
    """The model's shape from its config.json or GGUF metadata alone (no weight is read):
    what the tensor-parallel checks need before any rank starts."""
    from plugserve.model.default_model import default_model_path
    from plugserve.model.loader_gguf import open_gguf
    from plugserve.model.loader_gguf import read_arch as gguf_arch
    from plugserve.model.loader_hf import read_arch as hf_arch

    if path is None:
        return hf_arch(default_model_path())
    resolved = Path(path).expanduser()
    if resolved.suffix.lower() == ".gguf":
        return gguf_arch(open_gguf(resolved))
    if not resolved.is_dir():
        raise ModelLoadError(f"{resolved}: model folder does not exist (or is not a folder)")
    return hf_arch(resolved)


def load_shard(path: str | Path | None, shard: ModelShard, *, dtype: torch.dtype,
               device: torch.device | str, quantization: str | None = None,
               quant_activations: Activations = "int8") -> LoadedModel:
    """`plugserve.model.load_model` for one rank of a tensor-parallel model."""
    from plugserve.model.default_model import default_model_path

    opts: dict[str, Any] = {"quantization": quantization,
                            "quant_activations": quant_activations}
    if path is None:
        return load_hf_shard(default_model_path(), shard, dtype=dtype, device=device, **opts)
    resolved = Path(path).expanduser()
    if resolved.suffix.lower() == ".gguf":
        return load_gguf_shard(resolved, shard, dtype=dtype, device=device, **opts)
    return load_hf_shard(resolved, shard, dtype=dtype, device=device, **opts)


__all__ = ["ShardTarget", "gguf_slice_problem", "load_shard", "model_arch", "shard_plan"]
