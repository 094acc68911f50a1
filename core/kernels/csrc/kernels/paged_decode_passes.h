// The two passes of the paged decode (kernels/paged_decode.cpp) over one task's keys: the
// scores of all query heads of one row, then their probabilities times the values.
//
// Score pass: each key's rows of all kv heads are read together (one run of kv_heads x
// head_dim elements in the [slots, kv_heads, head_dim] cache), each kv head's row dotted with
// every query head of its group.
// With a bf16 cache under bf16 queries the AVX-512 BF16 copy multiplies bf16 pairs with
// vdpbf16ps (exact products, float32 sums: no rounding that float32 math would not do);
// every other case widens the keys to float32. A dot is a vector of partial sums; those of 16
// keys are summed across lanes together (a transposing tree in the AVX-512 copies) instead of
// one horizontal sum per key. Value pass: a block of heads x 4 vectors of float32
// accumulators in registers, the values streamed once per block.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace paged {

using namespace vec;
using E4M3 = c10::Float8_e4m3fn;
using E5M2 = c10::Float8_e5m2;

// Keys (and values) prefetched this many positions ahead: they lie at scattered pages. The
// score pass asks for the keys and values of all kv heads 8 keys ahead into L2 (96 lines in
// bf16, as many as 24 keys of one kv head were before a task read all kv heads), the value
// pass for one kv head's values 16 ahead into L1. Measured at 64 rows x 250 keys x 30 layers,
// bf16, 2 Zen 4 threads: 21.0 ms with keys 16 ahead into L1 and values into L2, 17.5 ms with
// both into L2 (fp32: 33.7 -> 30.6 ms). On the 2-thread Xeon (AVX-512 BF16), bf16, us per
// call at 64 x 250: 8 keys ahead ~760, 16 ~790, 6 and 12 ~860-920 (the lines in flight: 4 and
// 24 keys were no better); keys into L1 instead ~930; only every other line ~1060; no
// prefetch for a key that follows the previous one's slot (left to the hardware's streamer)
// ~815 (64 x 16..512: ~910 against ~790).
constexpr int64_t kScorePrefetchKeys = 8;
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

constexpr int64_t kBlock = 16;  // keys whose dots are summed across lanes together
static_assert(kBlock % kWidth == 0);

// scores[j] = scale * (the sum of the lanes of dots[j * kWidth ...]) for j < n <= kBlock;
// returns the largest of them. The AVX-512 copies sum the 16 vectors in one transposing tree
// (45 instructions) instead of one horizontal sum (8) per key.
inline float sum_lanes(const float* dots, int64_t n, float scale, float* scores) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kWidth == kBlock);
  __m512 t[8], w[4];
  for (int k = 0; k < 8; ++k) {  // key pairs: per quarter, (0, 2) from the first, (1, 3) second
    const __m512 x = _mm512_loadu_ps(dots + 2 * k * kWidth);
    const __m512 y = _mm512_loadu_ps(dots + (2 * k + 1) * kWidth);
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int k = 0; k < 4; ++k)  // per quarter: keys 4k .. 4k + 3, each summed over the quarter
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                                  _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                                  _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88),
                                   _mm512_shuffle_f32x4(z0, z1, 0xDD));
  const __m512 out = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  _mm512_mask_storeu_ps(scores, valid, out);
  return _mm512_mask_reduce_max_ps(valid, out);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = hsum(F::loadu(dots + j * kWidth)) * scale;
    mx = std::max(mx, scores[j]);
  }
  return mx;
#endif
}

// Scores of the n keys of a row for all its query heads (scores[g * n + j], query head g
// under kv head g / group) and their maxima. Each key's rows of all kv heads (one run of
// kv_heads x D elements in the usual layout) are loaded once and dotted with every query
// head of their group: with kBf16 (bf16 keys under bf16 queries, in the AVX-512 BF16 copy) as
// bf16 pairs with vdpbf16ps (exact products, float32 sums), otherwise widened to float32. The
// dots of kBlock keys are summed across lanes together.
template <typename TK, int64_t D, bool kBf16>
void scores_vec(const float* qf, const BF16* qb, int64_t kv_heads, int64_t group,
                const TK* base, int64_t head_stride, const int64_t* row_slots, int64_t n,
                int64_t token_stride, float scale, float k_scale, float* scores, float* row_max,
                const TK* v_base, int64_t v_head_stride, int64_t v_token_stride, float* dots) {
  constexpr int64_t kRowBytes = D * int64_t(sizeof(TK));
  const int64_t heads = kv_heads * group;
  // The keys before the first prefetch distance are asked for together, not one by one.
  for (int64_t j = 0; j < std::min(n, kScorePrefetchKeys); ++j) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const char* k_ahead =
          reinterpret_cast<const char*>(base + row_slots[j] * token_stride + h * head_stride);
      for (int64_t b = 0; b < kRowBytes; b += 64) prefetch_l2(k_ahead + b);
    }
  }
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t jj = 0; jj < nb; ++jj) {
      const int64_t j = j0 + jj;
      if (j + kScorePrefetchKeys < n) {
        // This key and its values, into L2 (the values for the value pass: a row's values
        // fit there). Asking for both keeps more lines in flight than fetching keys into L1,
        // which this pass, waiting on scattered keys, is limited by.
        const int64_t slot = row_slots[j + kScorePrefetchKeys];
        for (int64_t h = 0; h < kv_heads; ++h) {
          const char* k_ahead =
              reinterpret_cast<const char*>(base + slot * token_stride + h * head_stride);
          const char* v_ahead =
              reinterpret_cast<const char*>(v_base + slot * v_token_stride + h * v_head_stride);
          for (int64_t b = 0; b < kRowBytes; b += 64) {
            prefetch_l2(k_ahead + b);
            prefetch_l2(v_ahead + b);
          }
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const TK* kp = base + row_slots[j] * token_stride + h * head_stride;
        float* hdots = dots + h * group * kBlock * kWidth;
#if defined(__AVX512BF16__)
        if constexpr (kBf16) {
          constexpr int CB = D / 32;
          __m512i kc[CB];
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) kc[c] = _mm512_loadu_si512(kp + 32 * c);
          for (int64_t g = 0; g < group; ++g) {
            const BF16* qg = qb + (h * group + g) * D;
            __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < CB; ++c) {
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                     (__m512bh)kc[c]);
            }
            _mm512_storeu_ps(hdots + (g * kBlock + jj) * kWidth, acc);
          }
          continue;
        }
#endif
        constexpr int C = D / kWidth;
        Reg kc[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) kc[c] = load_cache(kp + kWidth * c, k_scale);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf + (h * group + g) * D;
          F acc = F(kc[0]) * F::loadu(qg);
#pragma GCC unroll 16
          for (int c = 1; c < C; ++c) acc = fmadd(kc[c], F::loadu(qg + kWidth * c), acc);
          acc.store(hdots + (g * kBlock + jj) * kWidth);
        }
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      const float mx = sum_lanes(dots + g * kBlock * kWidth, nb, scale, scores + g * n + j0);
      row_max[g] = std::max(row_max[g], mx);
    }
  }
  (void)qb;
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

}  // namespace paged
PLUGSERVE_ISA_END
