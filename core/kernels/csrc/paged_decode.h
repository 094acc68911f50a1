// Decode attention over the paged KV cache: see paged_decode.cpp, whose Python module calls
// it on its own, and decode_layer.cpp, which runs it inside a whole decoder layer.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace plugserve::paged {

// Widen one row of head_dim values to float32 (written so the compiler vectorises it).
inline void load_row(const float* __restrict src, float* __restrict dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void load_row(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    dst[d] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[d]) << 16);
  }
}
inline void load_row(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void add_scaled(float* __restrict acc, const float* __restrict x, float p, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * x[d];
}

#if defined(__AVX512F__)
// The AVX-512 passes for head_dim a multiple of 64 (64, 128, 256): one key's row is loaded
// into registers once and dotted with every query head of its group; the value pass keeps
// a 4-head x 64-dim block of accumulators in registers (named variables: GCC keeps arrays of
// vectors in memory) and streams the values once per block.
constexpr bool kHaveAvx512 = true;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Keys (and values) prefetched this many positions ahead: they lie at scattered pages. The
// score pass asks for keys and values 24 ahead into L2, the value pass for values 16 ahead
// into L1. Measured at 64 rows x 250 keys x 30 layers, bf16, 2 threads: 21.0 ms with keys
// 16 ahead into L1 and values into L2, 17.5 ms like this (fp32: 33.7 -> 30.6 ms).
constexpr int64_t kScorePrefetchKeys = 24;
constexpr int64_t kPrefetchKeys = 16;

template <typename T, int64_t D>
void scores_avx512(const float* qf, int64_t group, const T* base, const int64_t* row_slots,
                   int64_t n, int64_t token_stride, float scale, float* scores,
                   float* row_max, const T* v_base, int64_t v_token_stride) {
  constexpr int C = D / 16;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kScorePrefetchKeys < n) {
      // This key and its values, into L2 (the values for the value pass: a task's values
      // fit there). Asking for both keeps more lines in flight than fetching keys into L1,
      // which this pass, waiting on scattered keys, is limited by.
      const int64_t slot = row_slots[j + kScorePrefetchKeys];
      const char* k_ahead = reinterpret_cast<const char*>(base + slot * token_stride);
      const char* v_ahead = reinterpret_cast<const char*>(v_base + slot * v_token_stride);
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) {
        _mm_prefetch(k_ahead + b, _MM_HINT_T1);
        _mm_prefetch(v_ahead + b, _MM_HINT_T1);
      }
    }
    const T* kp = base + row_slots[j] * token_stride;
    __m512 kc[C];
    for (int c = 0; c < C; ++c) kc[c] = load16(kp + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      __m512 acc = _mm512_mul_ps(kc[0], _mm512_loadu_ps(qg));
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(kc[c], _mm512_loadu_ps(qg + 16 * c), acc);
      const float score = _mm512_reduce_add_ps(acc) * scale;
      scores[g * n + j] = score;
      row_max[g] = std::max(row_max[g], score);
    }
  }
}

#define PLUGSERVE_ZERO4(g) \
  __m512 a##g##0 = _mm512_setzero_ps(), a##g##1 = a##g##0, a##g##2 = a##g##0, a##g##3 = a##g##0;
#define PLUGSERVE_MAC4(g)                                              \
  if constexpr (GB > g) {                                              \
    const __m512 pg = _mm512_set1_ps(probs[(g0 + g) * n + j]);         \
    a##g##0 = _mm512_fmadd_ps(v0, pg, a##g##0);                        \
    a##g##1 = _mm512_fmadd_ps(v1, pg, a##g##1);                        \
    a##g##2 = _mm512_fmadd_ps(v2, pg, a##g##2);                        \
    a##g##3 = _mm512_fmadd_ps(v3, pg, a##g##3);                        \
  }
#define PLUGSERVE_STORE4(g)                                            \
  if constexpr (GB > g) {                                              \
    float* o = acc + (g0 + g) * D + d0;                                \
    _mm512_storeu_ps(o, a##g##0); _mm512_storeu_ps(o + 16, a##g##1);   \
    _mm512_storeu_ps(o + 32, a##g##2); _mm512_storeu_ps(o + 48, a##g##3); \
  }

// acc[g0 + g][d0 : d0 + 64] = sum_j probs[g0 + g][j] * v_j[d0 : d0 + 64] for g < GB.
template <typename T, int GB>
void values_block(const float* probs, int64_t n, int64_t g0, const T* base,
                  const int64_t* row_slots, int64_t token_stride, int64_t d0, int64_t D,
                  float* acc) {
  PLUGSERVE_ZERO4(0) PLUGSERVE_ZERO4(1) PLUGSERVE_ZERO4(2) PLUGSERVE_ZERO4(3)
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchKeys < n) {
      const char* ahead = reinterpret_cast<const char*>(base + row_slots[j + kPrefetchKeys] * token_stride + d0);
      for (int64_t b = 0; b < 64 * int64_t(sizeof(T)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    const T* vp = base + row_slots[j] * token_stride + d0;
    const __m512 v0 = load16(vp), v1 = load16(vp + 16), v2 = load16(vp + 32), v3 = load16(vp + 48);
    PLUGSERVE_MAC4(0) PLUGSERVE_MAC4(1) PLUGSERVE_MAC4(2) PLUGSERVE_MAC4(3)
  }
  PLUGSERVE_STORE4(0) PLUGSERVE_STORE4(1) PLUGSERVE_STORE4(2) PLUGSERVE_STORE4(3)
}
#undef PLUGSERVE_STORE4
#undef PLUGSERVE_MAC4
#undef PLUGSERVE_ZERO4

template <typename T, int64_t D>
void values_avx512(const float* probs, int64_t n, int64_t group, const T* base,
                   const int64_t* row_slots, int64_t token_stride, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    int64_t g0 = 0;
    for (; g0 + 4 <= group; g0 += 4)
      values_block<T, 4>(probs, n, g0, base, row_slots, token_stride, d0, D, acc);
    switch (group - g0) {
      case 3: values_block<T, 3>(probs, n, g0, base, row_slots, token_stride, d0, D, acc); break;
      case 2: values_block<T, 2>(probs, n, g0, base, row_slots, token_stride, d0, D, acc); break;
      case 1: values_block<T, 1>(probs, n, g0, base, row_slots, token_stride, d0, D, acc); break;
      default: break;
    }
  }
}
#else
constexpr bool kHaveAvx512 = false;
#endif

template <typename T, int64_t kDim>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& slots, const torch::Tensor& first_key,
                   const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t dim = kDim > 0 ? kDim : q.size(2);  // a constant lets the compiler unroll
  const int64_t kv_heads = k.size(1);
  const int64_t group = heads / kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* first_ptr = first_key.data_ptr<int64_t>();
  const int64_t* len_ptr = kv_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t slot_stride = slots.stride(0);
  const int64_t num_slots = std::min(k.size(0), v.size(0));
  const int64_t token_stride = k.stride(0), head_stride = k.stride(1);
  const int64_t v_token_stride = v.stride(0), v_head_stride = v.stride(1);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kv_row(dim), scores;
    std::vector<float> row_max(group), denom(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads;
      const int64_t start = std::max<int64_t>(first_ptr[i], 0), stop = len_ptr[i];
      const int64_t n = std::max<int64_t>(stop - start, 0);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_ptr + (i * heads + h * group + g) * dim, qf.data() + g * dim, dim);
      }
      scores.resize(group * n);  // every entry is written below
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      const int64_t* row_slots = slot_ptr + i * slot_stride + start;
      TORCH_CHECK(stop <= slots.size(1), "paged_decode: kv_lens[", i, "] = ", stop,
                  " exceeds the slot table's width ", slots.size(1));
      for (int64_t j = 0; j < n; ++j) {
        TORCH_CHECK(row_slots[j] >= 0 && row_slots[j] < num_slots, "paged_decode: slot ",
                    row_slots[j], " of query ", i, " is outside the cache [0, ", num_slots, ")");
      }
      constexpr bool kVector = kHaveAvx512 && kDim > 0 && kDim % 64 == 0;
      if constexpr (kVector) {
#if defined(__AVX512F__)
        scores_avx512<T, kDim>(qf.data(), group, k_ptr + h * head_stride, row_slots, n,
                               token_stride, fscale, scores.data(), row_max.data(),
                               v_ptr + h * v_head_stride, v_token_stride);
#endif
      } else {
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_ptr + row_slots[j] * token_stride + h * head_stride, kv_row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float score = dot(qf.data() + g * dim, kv_row.data(), dim) * fscale;
            scores[g * n + j] = score;
            row_max[g] = std::max(row_max[g], score);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict s = scores.data() + g * n;
        const float m = row_max[g];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          s[j] = plugserve::exp_f32(s[j] - m);
          sum += s[j];
        }
        denom[g] = sum;
      }
      if constexpr (kVector) {
#if defined(__AVX512F__)
        values_avx512<T, kDim>(scores.data(), n, group, v_ptr + h * v_head_stride, row_slots,
                               v_token_stride, acc.data());
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          load_row(v_ptr + row_slots[j] * v_token_stride + h * v_head_stride, kv_row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            add_scaled(acc.data() + g * dim, kv_row.data(), scores[g * n + j], dim);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        // A row with no keys (n == 0) gets zeros, like a fully masked softmax would not.
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        T* o = out_ptr + (i * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& slots, const torch::Tensor& first_key,
                  const torch::Tensor& kv_lens, double scale, torch::Tensor& out) {
  switch (q.size(2)) {
    case 64: decode_kernel<T, 64>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    case 128: decode_kernel<T, 128>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    case 256: decode_kernel<T, 256>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    default: decode_kernel<T, 0>(q, k, v, slots, first_key, kv_lens, scale, out);
  }
}

inline torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                           torch::Tensor slots, torch::Tensor first_key, torch::Tensor kv_lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k.size(2) && k.size(2) == v.size(2), "head_dim differs");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must be contiguous in head_dim");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.stride(1) == 1,
              "slots must be a row-contiguous int64 [rows, max_len] table");
  TORCH_CHECK(first_key.scalar_type() == torch::kInt64 && kv_lens.scalar_type() == torch::kInt64,
              "first_key and kv_lens must be int64");
  TORCH_CHECK(slots.size(0) == q.size(0) && kv_lens.size(0) == q.size(0) &&
              first_key.size(0) == q.size(0), "one slot row, length and start per query");
  q = q.contiguous();
  first_key = first_key.contiguous();
  kv_lens = kv_lens.contiguous();
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case torch::kFloat: dispatch_dim<float>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    case torch::kBFloat16:
      dispatch_dim<c10::BFloat16>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    case torch::kHalf:
      dispatch_dim<c10::Half>(q, k, v, slots, first_key, kv_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace plugserve::paged
