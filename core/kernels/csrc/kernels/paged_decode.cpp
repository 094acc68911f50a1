// Decode attention straight from the paged KV cache, and the KV store before it.
//
// One query token per row q[i] ([heads, head_dim]) attends to the keys at
// slots[i, first_key[i] : kv_lens[i]] of the cache buffers k/v ([slots, kv_heads, head_dim]).
// Nothing is gathered: each (row, kv head) task reads its keys and values where they lie,
// once, widening bf16 / fp16 / fp8 to float32 on the fly, and computes the softmax in float32
// for the query heads that share that kv head (grouped-query attention). The output has q's
// dtype.
//
// For head_dim 64, 128 and 256 the passes are vector code: one key's row is loaded into
// registers once and dotted with every query head of its group; the value pass keeps a block
// of heads x 4 vectors of accumulators in registers and streams the values once per block.
// Other head_dims run plain loops the compiler vectorises.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <vector>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using E4M3 = c10::Float8_e4m3fn;
using E5M2 = c10::Float8_e5m2;

// Keys (and values) prefetched this many positions ahead: they lie at scattered pages. The
// score pass asks for keys and values 24 ahead into L2, the value pass for values 16 ahead
// into L1. Measured at 64 rows x 250 keys x 30 layers, bf16, 2 Zen 4 threads: 21.0 ms with
// keys 16 ahead into L1 and values into L2, 17.5 ms like this (fp32: 33.7 -> 30.6 ms).
constexpr int64_t kScorePrefetchKeys = 24;
constexpr int64_t kPrefetchKeys = 16;
// Query heads per block of the value pass: GB x 4 accumulators + 4 values + 1 must fit.
constexpr int kHeadBlock = kRegisters >= 32 ? 4 : 2;

// One cache element as float32 (fp8 values times the buffer's scale).
template <typename T>
inline float cache_value(T v, float scale) {
  if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
    return static_cast<float>(v) * scale;
  } else {
    return to_float(v);
  }
}

// kWidth cache values as float32.
template <typename T>
inline F load_cache(const T* p, float scale) {
  if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
    __at_align__ float tmp[kWidth];
    for (int64_t i = 0; i < kWidth; ++i) tmp[i] = static_cast<float>(p[i]);
    return F::loadu(tmp) * F(scale);
  } else {
    return load(p);
  }
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = cache_value(src[d], scale);
}

template <typename TK, int64_t D>
void scores_vec(const float* qf, int64_t group, const TK* base, const int64_t* row_slots,
                int64_t n, int64_t token_stride, float scale, float k_scale, float* scores,
                float* row_max, const TK* v_base, int64_t v_token_stride) {
  constexpr int C = D / kWidth;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kScorePrefetchKeys < n) {
      // This key and its values, into L2 (the values for the value pass: a task's values
      // fit there). Asking for both keeps more lines in flight than fetching keys into L1,
      // which this pass, waiting on scattered keys, is limited by.
      const int64_t slot = row_slots[j + kScorePrefetchKeys];
      const char* k_ahead = reinterpret_cast<const char*>(base + slot * token_stride);
      const char* v_ahead = reinterpret_cast<const char*>(v_base + slot * v_token_stride);
      for (int64_t b = 0; b < D * int64_t(sizeof(TK)); b += 64) {
        prefetch_l2(k_ahead + b);
        prefetch_l2(v_ahead + b);
      }
    }
    const TK* kp = base + row_slots[j] * token_stride;
    Reg kc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) kc[c] = load_cache(kp + kWidth * c, k_scale);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      F acc = F(kc[0]) * F::loadu(qg);
#pragma GCC unroll 16
      for (int c = 1; c < C; ++c) acc = fmadd(kc[c], F::loadu(qg + kWidth * c), acc);
      const float score = hsum(acc) * scale;
      scores[g * n + j] = score;
      row_max[g] = std::max(row_max[g], score);
    }
  }
}

// acc[g0 + g][d0 : d0 + 4 kWidth] = sum_j probs[g0 + g][j] * v_j[d0 : ...] for g < GB.
template <typename TK, int GB>
void values_block(const float* probs, int64_t n, int64_t g0, const TK* base,
                  const int64_t* row_slots, int64_t token_stride, float v_scale, int64_t d0,
                  int64_t D, float* acc) {
  Reg a[GB][4];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[g][c] = F(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchKeys < n) {
      const char* ahead = reinterpret_cast<const char*>(
          base + row_slots[j + kPrefetchKeys] * token_stride + d0);
      for (int64_t b = 0; b < 4 * kWidth * int64_t(sizeof(TK)); b += 64) prefetch_l1(ahead + b);
    }
    const TK* vp = base + row_slots[j] * token_stride + d0;
    const Reg v[4] = {load_cache(vp, v_scale), load_cache(vp + kWidth, v_scale),
                      load_cache(vp + 2 * kWidth, v_scale),
                      load_cache(vp + 3 * kWidth, v_scale)};
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const F pg(probs[(g0 + g) * n + j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[g][c] = fmadd(v[c], pg, a[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) F(a[g][c]).store(acc + (g0 + g) * D + d0 + kWidth * c);
}

template <typename TK, int64_t D>
void values_vec(const float* probs, int64_t n, int64_t group, const TK* base,
                const int64_t* row_slots, int64_t token_stride, float v_scale, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 4 * kWidth) {
    int64_t g0 = 0;
    for (; g0 + kHeadBlock <= group; g0 += kHeadBlock)
      values_block<TK, kHeadBlock>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D,
                                   acc);
    switch (group - g0) {
      case 3:
        if constexpr (kHeadBlock > 3)
          values_block<TK, 3>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      case 2:
        if constexpr (kHeadBlock > 2)
          values_block<TK, 2>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      case 1:
        values_block<TK, 1>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      default: break;
    }
  }
}

// q rows of the queries' dtype as float32, and float32 results stored in it (a runtime
// switch: the kernel itself is compiled once per cache type and head_dim, not per q type).
inline void load_query(const PagedDecodeArgs& a, int64_t offset, float* dst, int64_t n) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "paged_decode", {
    const T* src = static_cast<const T*>(a.q) + offset;
    for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
  });
}

inline void store_output(const PagedDecodeArgs& a, int64_t offset, const float* src, float inv,
                         int64_t n) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "paged_decode", {
    T* dst = static_cast<T*>(a.out) + offset;
    for (int64_t d = 0; d < n; ++d) dst[d] = from_float<T>(src[d] * inv);
  });
}

template <typename TK, int64_t kDim>
void decode(const PagedDecodeArgs& a) {
  const int64_t heads = a.heads, kv_heads = a.kv_heads;
  const int64_t dim = kDim > 0 ? kDim : a.dim;  // a constant lets the compiler unroll
  const int64_t group = heads / kv_heads;
  const TK* k_ptr = static_cast<const TK*>(a.k);
  const TK* v_ptr = static_cast<const TK*>(a.v);
  const float scale = a.scale;

  at::parallel_for(0, a.rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kv_row(dim), scores;
    std::vector<float> row_max(group), denom(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads;
      const int64_t start = std::max<int64_t>(a.first_key[i], 0), stop = a.kv_lens[i];
      const int64_t n = std::max<int64_t>(stop - start, 0);
      load_query(a, (i * heads + h * group) * dim, qf.data(), group * dim);
      scores.resize(group * n);  // every entry is written below
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      const int64_t* row_slots = a.slots + i * a.slot_stride + start;
      TORCH_CHECK(stop <= a.slot_width, "paged_decode: kv_lens[", i, "] = ", stop,
                  " exceeds the slot table's width ", a.slot_width);
      for (int64_t j = 0; j < n; ++j) {
        TORCH_CHECK(row_slots[j] >= 0 && row_slots[j] < a.num_slots, "paged_decode: slot ",
                    row_slots[j], " of query ", i, " is outside the cache [0, ", a.num_slots,
                    ")");
      }
      const TK* k_base = k_ptr + h * a.k_head_stride;
      const TK* v_base = v_ptr + h * a.v_head_stride;
      constexpr bool kVector = kDim > 0 && kDim % (4 * kWidth) == 0;
      if constexpr (kVector) {
        scores_vec<TK, kDim>(qf.data(), group, k_base, row_slots, n, a.k_token_stride, scale,
                             a.k_scale, scores.data(), row_max.data(), v_base,
                             a.v_token_stride);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_base + row_slots[j] * a.k_token_stride, kv_row.data(), dim, a.k_scale);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kv_row[d];
            const float score = dot * scale;
            scores[g * n + j] = score;
            row_max[g] = std::max(row_max[g], score);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict s = scores.data() + g * n;
        const float m = row_max[g];
        float sum = 0.f;
        int64_t j = 0;
        F vsum(0.0f);
        for (; j + kWidth <= n; j += kWidth) {
          const F e = vec::exp(F::loadu(s + j) - F(m));
          e.store(s + j);
          vsum = vsum + e;
        }
        sum = hsum(vsum);
        for (; j < n; ++j) {
          s[j] = exp_f32(s[j] - m);
          sum += s[j];
        }
        denom[g] = sum;
      }
      if constexpr (kVector) {
        values_vec<TK, kDim>(scores.data(), n, group, v_base, row_slots, a.v_token_stride,
                             a.v_scale, acc.data());
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          load_row(v_base + row_slots[j] * a.v_token_stride, kv_row.data(), dim, a.v_scale);
          for (int64_t g = 0; g < group; ++g) {
            float* __restrict o = acc.data() + g * dim;
            const float p = scores[g * n + j];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) o[d] += p * kv_row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        // A row with no keys (n == 0) gets zeros, like a fully masked softmax would not.
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        store_output(a, (i * heads + h * group + g) * dim, acc.data() + g * dim, inv, dim);
      }
    }
  });
}

template <typename TK>
void dispatch_dim(const PagedDecodeArgs& a) {
  switch (a.dim) {
    case 64: decode<TK, 64>(a); break;
    case 128: decode<TK, 128>(a); break;
    case 256: decode<TK, 256>(a); break;
    default: decode<TK, 0>(a);
  }
}

// The largest finite value of a cache format: fp8 stores saturate there (e4m3fn has no
// infinity, and c10's conversion would make an out-of-range value NaN).
template <typename TD>
constexpr float kSaturate = std::numeric_limits<float>::infinity();
template <>
constexpr float kSaturate<E4M3> = 448.0f;
template <>
constexpr float kSaturate<E5M2> = 57344.0f;

template <typename TS, typename TD>
void store_converted(const StoreRowsArgs& a) {
  const TS* src = static_cast<const TS*>(a.src);
  TD* dst = static_cast<TD*>(a.dst);
  const float inv = 1.0f / a.scale;
  const float hi = kSaturate<TD>;
  for (int64_t r = 0; r < a.rows; ++r) {
    const TS* s = src + r * a.src_stride;
    TD* d = dst + a.slots[r] * a.dst_stride;
    for (int64_t e = 0; e < a.row_elements; ++e) {
      d[e] = static_cast<TD>(std::clamp(to_float(s[e]) * inv, -hi, hi));
    }
  }
}

}  // namespace

// The cache holds the queries' type, bf16 (a bf16 cache under float32 weights) or fp8.
void paged_decode(const PagedDecodeArgs& a) {
  switch (a.kv_dtype) {
    case Dtype::f32: dispatch_dim<float>(a); break;
    case Dtype::bf16: dispatch_dim<BF16>(a); break;
    case Dtype::f16: dispatch_dim<Half>(a); break;
    case Dtype::f8e4m3: dispatch_dim<E4M3>(a); break;
    case Dtype::f8e5m2: dispatch_dim<E5M2>(a); break;
  }
}

void store_rows(const StoreRowsArgs& a) {
  if (a.src_dtype == a.dst_dtype) {
    const int64_t bytes = dtype_bytes(a.src_dtype);
    const char* src = static_cast<const char*>(a.src);
    char* dst = static_cast<char*>(a.dst);
    for (int64_t r = 0; r < a.rows; ++r) {
      std::memcpy(dst + a.slots[r] * a.dst_stride * bytes, src + r * a.src_stride * bytes,
                  a.row_elements * bytes);
    }
    return;
  }
  switch (a.dst_dtype) {
    case Dtype::bf16:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, BF16>(a));
      break;
    case Dtype::f8e4m3:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, E4M3>(a));
      break;
    case Dtype::f8e5m2:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, E5M2>(a));
      break;
    default: TORCH_CHECK(false, "store_rows: converts to bf16 and fp8 caches only");
  }
}

PLUGSERVE_ISA_END
