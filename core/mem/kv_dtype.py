"""The dtype an engine's KV pools store: `EngineConfig.kv_cache_dtype`, with what "auto"
resolves to.

"auto" is the compute dtype, except for a GGUF file's quantized weights run with int8
activations (llama.cpp's scheme) in float32: there it is bfloat16, as llama.cpp keeps an f16
cache by default. Attention widens the cache to float32 as it reads it, and a batch-1 decode
reads half the KV bytes. `quant_activations="float"` keeps the compute dtype (the mode whose
greedy tokens equal transformers'), and so does a backend that does not read a bfloat16 cache.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from plugserve.pools.kv_pool import kv_cache_torch_dtype


def kv_pool_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, *, quantized_gguf: bool,
    quant_activations: str, backend_kv_dtypes: Collection[str],
) -> torch.dtype:
    """What the KV pools store for `kv_cache_dtype` (a name of `EngineConfig.kv_cache_dtype`);
    `quantized_gguf`: the model holds a GGUF file's blocks (not dequantized)."""
    if kv_cache_dtype != "auto":
        return kv_cache_torch_dtype(kv_cache_dtype, model_dtype)
    if (quantized_gguf and quant_activations == "int8" and model_dtype == torch.float32
            and "bfloat16" in backend_kv_dtypes):
        return torch.bfloat16
    return model_dtype
