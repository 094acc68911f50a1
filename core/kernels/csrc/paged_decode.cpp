// Decode attention straight from the paged KV cache, on the CPU.
//
// One query token per row q[i] ([heads, head_dim]) attends to the keys at
// slots[i, first_key[i] : kv_lens[i]] of the cache buffers k/v ([slots, kv_heads, head_dim]).
// Nothing is gathered: each (row, kv head) task reads its keys and values where they lie,
// once, converting bf16/fp16 to float32 on the fly, and computes the softmax in float32 for
// the query heads that share that kv head (grouped-query attention). The output has q's dtype.
//
// The Python side (plugserve/kernels/paged_decode.py) holds the reference this is tested
// against and decides when to use it.
#include <torch/extension.h>

#include "paged_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &plugserve::paged::paged_decode,
        "decode attention over a paged KV cache (CPU)");
}
