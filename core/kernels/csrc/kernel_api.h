// The kernels' entry points: what every ISA copy of csrc/kernels/ defines, and what the ops in
// csrc/ops/ call through the dispatch table of the ISA chosen at run time (dispatch.h).
//
// An entry point takes one plain struct of pointers and sizes (no at::Tensor: the kernel
// sources compile against ATen's vector headers only, once per ISA, which keeps the build
// short). The ops check shapes and dtypes, allocate outputs and fill the struct.
//
// To add a kernel: its argument struct here, one line in PLUGSERVE_KERNELS, its source in
// csrc/kernels/ (defining the function in namespace plugserve::PLUGSERVE_ISA, see
// vec/pvec.h), and its op in csrc/ops/. core/kernels/README.md walks through it.
#pragma once

#include <cstdint>

namespace plugserve {

// Element types a kernel may be handed (the ops map torch dtypes onto these).
enum class Dtype : int32_t { f32, bf16, f16, f8e4m3, f8e5m2 };

inline int64_t dtype_bytes(Dtype d) {
  return d == Dtype::f32 ? 4 : (d == Dtype::bf16 || d == Dtype::f16) ? 2 : 1;
}

// Where row i of a tensor starts, for every dim but the last (contiguous) one: dims laid out
// one after another are merged, so a contiguous or 2-d tensor is one multiply.
struct RowLayout {
  static constexpr int kMaxDims = 8;
  int32_t dims = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  int64_t offset(int64_t row) const {
    int64_t off = 0;
    for (int32_t d = dims - 1; d > 0; --d) {
      off += (row % sizes[d]) * strides[d];
      row /= sizes[d];
    }
    return dims == 0 ? 0 : off + row * strides[0];
  }
};

// out [M, N] = x [M, K] @ w [N, K].T (+ bias), in float32 sums. x, w and out share `dtype`
// (f32 or bf16); rows of x are x_stride apart, w and out are contiguous; bias is float32.
struct SkinnyLinearArgs {
  const void* x;
  int64_t x_stride;
  const void* w;
  const float* bias;  // nullptr: none
  void* out;
  int64_t M, K, N;
  Dtype dtype;
};

// The same product in float32 for a few dozen rows, the weight packed once into panels of
// panel_gemm_width() output columns: packed [panels][K][width], zero past N (the op packs it:
// plugserve.kernels.panel_gemm). Rows of x are x_stride apart; out is contiguous [M, N].
struct PanelGemmArgs {
  const float* x;
  int64_t x_stride;
  const void* packed;  // of w_dtype (f32, or bf16 / f16 widened in registers)
  Dtype w_dtype;
  const float* bias;  // nullptr: none
  float* out;
  int64_t M, K, N;
};

// The same product for more rows with bf16 (or f16) weights on a CPU without native half
// dot products: each thread widens a block of the weight to float32 in its cache and runs a
// float32 register-tiled GEMM over it, so the weight is read once, in its own dtype. x and
// out are `act_dtype` (f32, bf16 or f16), w is `w_dtype`.
struct WideningGemmArgs {
  const void* x;
  int64_t x_stride;
  const void* w;
  const float* bias;
  void* out;
  int64_t M, K, N;
  Dtype act_dtype, w_dtype;
};

// Decode attention over a paged cache: query row i ([heads, dim] at q + i * heads * dim)
// attends to the keys at slots[i * slot_stride + first_key[i] .. kv_lens[i]) of the k / v
// buffers ([slots, kv_heads, dim], strided). q and out share `dtype`; the cache holds
// `kv_dtype` (the same, or an fp8 format read as value * kv_scale).
struct PagedDecodeArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  Dtype dtype, kv_dtype;
  int64_t k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  const int64_t* slots;
  int64_t slot_stride, slot_width;
  const int64_t* first_key;
  const int64_t* kv_lens;
  int64_t num_slots;
  int64_t rows, heads, kv_heads, dim;
  float scale;
  float k_scale, v_scale;
};

// Causal (optionally windowed) prefill attention of one sequence: q, out [tokens, heads, dim]
// contiguous; k, v [prefix + tokens, kv_heads, dim] strided. window 0: none.
struct PrefillArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  Dtype dtype;
  // Element strides: q may be a view of the qkv projection's rows (its last dim contiguous).
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  int64_t tokens, heads, kv_heads, dim, prefix, window;
  float scale;
};

// The first key position a query at position `pos` sees (a sliding window shows keys
// after pos - window; window 0 means none), never before `floor`.
inline int64_t first_visible_key(int64_t pos, int64_t window, int64_t floor) {
  return window > 0 && pos - window + 1 > floor ? pos - window + 1 : floor;
}

// Where one prefill call's queries and keys lie, as both prefill kernels read it; each adds
// how it pads the packed keys and cuts the queries into tasks.
struct PrefillShape {
  int64_t tokens;    // E: query tokens
  int64_t heads;     // H
  int64_t q_token_stride, q_head_stride;  // elements between q's tokens / heads
  int64_t kv_heads;  // KVH
  int64_t group;     // H / KVH
  int64_t dim;       // D
  int64_t prefix;    // position of the first query token
  int64_t window;    // 0: none; else a key is visible when its position > query's - window
  // With a window no query sees a key before position prefix - window + 1: those are not
  // packed (a long cached prefix costs nothing then).
  int64_t key_lo;    // first key position any query sees: the packed keys start here
  int64_t keys;      // packed keys: prefix + E - key_lo
  float scale;

  explicit PrefillShape(const PrefillArgs& a)
      : tokens(a.tokens), heads(a.heads), q_token_stride(a.q_token_stride),
        q_head_stride(a.q_head_stride), kv_heads(a.kv_heads), group(a.heads / a.kv_heads),
        dim(a.dim), prefix(a.prefix), window(a.window),
        key_lo(first_visible_key(a.prefix, a.window, 0)), keys(a.prefix + a.tokens - key_lo),
        scale(a.scale) {}
};

// RMSNorm of each row of x (and, for add_rms_norm, of residual + x, stored to new_residual).
struct NormArgs {
  const void* x;
  RowLayout x_rows;
  const void* residual;
  RowLayout residual_rows;
  const void* weight;
  void* out;           // contiguous [rows, n]
  void* new_residual;  // contiguous [rows, n]; add_rms_norm only
  int64_t n, rows;
  float eps;
  bool unit_offset;
  Dtype dtype;
};

// out [rows, width] = SiLU(gate) * up for gate | up the halves of each input row.
struct SiluMulArgs {
  const void* gate_up;
  RowLayout rows_layout;
  void* out;
  int64_t width, rows;
  Dtype dtype;
};

// Rotary embedding of x [tokens, heads, 2 * half] in place; cos / sin [tokens, half].
struct RopeArgs {
  void* x;
  int64_t tokens, heads, half, token_stride, head_stride;
  const void* cos;
  const void* sin;
  int64_t cos_stride, sin_stride;
  Dtype dtype;
};

// Each row's largest value and the index of its first occurrence (NaN wins), float32 logits.
struct RowArgmaxArgs {
  const float* logits;
  int64_t rows, n;
  float* max_out;
  int64_t* index_out;
};

// Store rows [n, row_bytes] at slots of a buffer (the KV write of a decode step), converting
// from `src_dtype` to `dst_dtype` (the same, or an fp8 cache format: value / scale).
struct StoreRowsArgs {
  const void* src;
  int64_t src_stride;  // elements between source rows
  void* dst;
  int64_t dst_stride;  // elements between destination slots
  const int64_t* slots;
  int64_t rows, row_elements;
  Dtype src_dtype, dst_dtype;
  float scale;
};

// The GGML block formats the quantized linear reads as stored (plugserve.quant.types).
enum class QuantFormat : int32_t { q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k };

// Bytes of one block, and weights per block, of each format (ggml-common.h).
constexpr int64_t quant_block_bytes(QuantFormat f) {
  switch (f) {
    case QuantFormat::q8_0: return 34;
    case QuantFormat::q4_0: return 18;
    case QuantFormat::q4_1: return 20;
    case QuantFormat::q5_0: return 22;
    case QuantFormat::q5_1: return 24;
    case QuantFormat::q4_k: return 144;
    case QuantFormat::q5_k: return 176;
    case QuantFormat::q6_k: return 210;
  }
  return 0;
}
constexpr int64_t quant_block_elems(QuantFormat f) {
  return f == QuantFormat::q4_k || f == QuantFormat::q5_k || f == QuantFormat::q6_k ? 256 : 32;
}

// out [M, N] = x [M, K] @ dequantize(w).T (+ bias) for a few rows of x: w is N rows of
// `w_row_bytes` bytes of `format` blocks, one after another (K a multiple of the block size).
// x and out are `dtype` (f32 or bf16); bias is float32. int8_activations: x is rounded per
// 32-block to int8 (scale max|x| / 127, stored as fp16) and multiplied with integer dot
// products; otherwise the blocks are widened to float32 and multiplied with float32 FMAs.
struct QuantLinearArgs {
  const void* x;
  int64_t x_stride;
  const uint8_t* w;
  int64_t w_row_bytes;
  const float* bias;  // nullptr: none
  void* out;
  int64_t M, K, N;
  QuantFormat format;
  Dtype dtype;
  bool int8_activations;
  int64_t out_stride = 0;  // elements from one row of out to the next; 0: N
};

// Several quantized weights sharing x (the parts of a projection stacked along the outputs),
// each QuantLinearArgs with its own w, bias, N, format and out (its first column of a shared
// output, out_stride apart): x is rounded to int8 once and the parts' rows split between the
// threads in one pass. int8 activations, the same x, M, K and dtype in every part.
struct QuantLinearPartsArgs {
  const QuantLinearArgs* parts;
  int64_t count;
};

// out [rows, K] (`dtype`: f32 or bf16) = the rows of `format` blocks at w dequantized.
struct QuantDequantizeArgs {
  const uint8_t* w;
  int64_t w_row_bytes;
  void* out;
  int64_t rows, K;
  QuantFormat format;
  Dtype dtype;
};

// out [M, K] (`out_dtype`: bf16 or f32, contiguous) = x [M, K] (`dtype`: f32 or bf16, rows
// x_stride apart) as the many-row quantized GEMM multiplies it: rounded through int8 per
// 32-block (the few-row kernel's int8 activations: scale max|x| / 127 kept as fp16, quants
// rounded half to even) when int8, else as is; the value then rounded to out_dtype.
struct QuantActivationsArgs {
  const void* x;
  int64_t x_stride;
  void* out;
  int64_t M, K;
  Dtype dtype;      // x's
  Dtype out_dtype;  // out's (f32 or bf16, contiguous)
  bool int8;
};

// out [M, N] (`out_dtype`: f32 or bf16, contiguous) = x [M, K] (`x_dtype`: f32 or bf16, rows
// x_stride apart) taken to bf16 (rounded through int8 per 32-block first when int8, as
// quant_activations does) @ dequantize(w).T rounded to bf16, summed in float32 (+ bias,
// float32) with AMX tiles. The kernel returns false, writing nothing, where this copy or this
// CPU (or its OS) has no AMX, or for a prefill's rows against a weight it leaves to oneDNN.
// The same arguments for quant_gemm_vnni (kernels/quant_vnni.cpp): int8 activations only,
// exact integer products per weight group with AVX512-VNNI, float32 sums; false, writing
// nothing, where this copy or this CPU has no VNNI or the activations are not int8. And for
// quant_gemm_maddubs (kernels/quant_maddubs.cpp): the same products with AVX2's vpmaddubsw,
// false where this copy has no AVX2 or the activations are not int8 (maddubs_auto: whether
// the automatic choice takes it for this format and rows of x).
struct QuantGemmArgs {
  const void* x;
  int64_t x_stride;
  const uint8_t* w;
  int64_t w_row_bytes;
  const float* bias;  // nullptr: none
  void* out;
  int64_t M, K, N;
  QuantFormat format;
  Dtype out_dtype;
  Dtype x_dtype;
  bool int8;
};

// out [M, N] (bf16, contiguous) = x [M, K] (bf16, rows x_stride apart) @ w.T (+ bias,
// float32), summed in float32 with AMX tiles, w [N, K] bf16 prepacked (dense_amx.cpp: strips
// of 32 rows, zero past N, in the VNNI-pair layout of B tiles; K a multiple of 32). The kernel
// returns false, writing nothing, where this copy or this CPU (or its OS) has no AMX.
struct DenseAmxArgs {
  const void* x;
  int64_t x_stride;
  const void* w_packed;
  const float* bias;  // nullptr: none
  void* out;
  int64_t M, K, N;
};

// name, return type, parameters: every ISA copy defines each of these.
#define PLUGSERVE_KERNELS(X)                                   \
  X(void, skinny_linear, (const SkinnyLinearArgs& args))       \
  X(void, widening_gemm, (const WideningGemmArgs& args))       \
  X(void, panel_gemm, (const PanelGemmArgs& args))             \
  X(int64_t, panel_gemm_width, ())                             \
  X(void, paged_decode, (const PagedDecodeArgs& args))         \
  X(void, prefill_attention, (const PrefillArgs& args))        \
  X(bool, prefill_attention_amx, (const PrefillArgs& args))    \
  X(void, rms_norm, (const NormArgs& args))                    \
  X(void, add_rms_norm, (const NormArgs& args))                \
  X(void, silu_mul, (const SiluMulArgs& args))                 \
  X(void, rope, (const RopeArgs& args))                        \
  X(void, row_argmax, (const RowArgmaxArgs& args))             \
  X(void, store_rows, (const StoreRowsArgs& args))             \
  X(void, quant_linear, (const QuantLinearArgs& args))         \
  X(void, quant_linear_parts, (const QuantLinearPartsArgs& args)) \
  X(void, quant_dequantize, (const QuantDequantizeArgs& args))  \
  X(void, quant_activations, (const QuantActivationsArgs& args)) \
  X(bool, quant_gemm_amx, (const QuantGemmArgs& args))         \
  X(bool, quant_gemm_vnni, (const QuantGemmArgs& args))        \
  X(bool, vnni_usable, ())                                     \
  X(bool, quant_gemm_maddubs, (const QuantGemmArgs& args))     \
  X(bool, maddubs_usable, ())                                  \
  X(bool, maddubs_auto, (QuantFormat format, int64_t rows))    \
  X(bool, dense_amx_linear, (const DenseAmxArgs& args))        \
  X(bool, amx_usable, ())

#define PLUGSERVE_DECLARE_KERNEL(ret, name, params) ret name params;

// Every ISA's namespace declares them (the builder compiles only the ones this CPU runs).
namespace scalar { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace avx2 { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace avx512 { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace avx512_vnni { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace avx512_bf16 { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace neon { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }
namespace sve256 { PLUGSERVE_KERNELS(PLUGSERVE_DECLARE_KERNEL) }

}  // namespace plugserve
