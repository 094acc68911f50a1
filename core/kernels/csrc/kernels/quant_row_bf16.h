// A row of x as the many-row quantized GEMM multiplies it (included by quant_gemm.cpp and
// quant_amx.cpp inside their ISA namespace, after quant_blocks.h): bf16 (float32 where the
// copy has no native bf16 product), rounded through int8 per 32-block first for int8
// activations (as reference.quantize_activations_int8).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

PLUGSERVE_ISA_BEGIN
namespace quant {

using vec::BF16;

#if defined(CPU_CAPABILITY_AVX512)
// Lane j of the result: the largest value of m[j] (16 vectors reduced together, ~3 operations
// per vector instead of a reduction of each).
inline __m512 max_of_each(__m512 m[16]) {
  __m512 a[8], b[4], c[2];
  // a[i], per 128-bit lane: m[2i] at positions 0, 2 and m[2i + 1] at 1, 3, two values each
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_max_ps(_mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]),
                         _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]));
  // b[i], per 128-bit lane: position p the lane's largest of m[4i + p]
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_max_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // then across the 128-bit lanes: lanes (0, 1) and (2, 3) of each, then of the pairs
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_max_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_max_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The 32-blocks of one row of x [K] (float or BF16) rounded through int8 as
// reference.quantize_activations_int8 rounds them (divide by the float32 scale, round half to
// even; the scale itself rounded to fp16): fn(k0, qlo, qhi, d) for each block at k0, with its
// 32 quants as whole float32 values (two vectors) and d, the fp16-rounded scale.
template <typename T, typename Fn>
inline void for_each_int8_block(const T* x, int64_t K, Fn&& fn) {
  const auto load32 = [&](int64_t k, __m512& lo, __m512& hi) {
    if constexpr (std::is_same_v<T, float>) {
      lo = _mm512_loadu_ps(x + k);
      hi = _mm512_loadu_ps(x + k + 16);
    } else {
      const auto widen = [](const T* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      };
      lo = widen(x + k);
      hi = widen(x + k + 16);
    }
  };
  constexpr int kEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  // 16 blocks at a time: their max |x| first (independent reductions), then their scales in
  // one vector, then the quants; no block waits on the one before.
  for (int64_t b0 = 0; b0 < K / kBlock; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, K / kBlock - b0);
    __m512 m[16];
    for (int64_t j = 0; j < 16; ++j) {
      m[j] = _mm512_setzero_ps();
      if (j < nb) {
        __m512 lo, hi;
        load32((b0 + j) * kBlock, lo, hi);
        m[j] = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
      }
    }
    alignas(64) float scale[16], d[16], inv[16];
    const __m512 s = _mm512_div_ps(max_of_each(m), _mm512_set1_ps(127.0f));
    _mm512_store_ps(scale, s);
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtps_ph(s, kEven)));  // rounded to fp16
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), s));
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t k0 = (b0 + j) * kBlock;
      __m512 lo, hi;
      load32(k0, lo, hi);
      __m512 qlo = _mm512_setzero_ps(), qhi = _mm512_setzero_ps();
      if (scale[j] > 0.0f) {
        // round(x / scale) half to even, as the reference divides. x * (1 / scale) is
        // within 2 ulp of the quotient (|x / scale| <= 127: 2 ulp <= 2^-16), so it rounds
        // to the same integer unless it lies that close to a half; only then is the block
        // divided.
        const __m512 iv = _mm512_set1_ps(inv[j]);
        const __m512 tlo = _mm512_mul_ps(lo, iv), thi = _mm512_mul_ps(hi, iv);
        qlo = _mm512_roundscale_ps(tlo, kEven);
        qhi = _mm512_roundscale_ps(thi, kEven);
        // |t - q| <= 0.5 (q is the integer nearest t): near a half is above 0.5 - 2^-14.
        const __m512 near = _mm512_set1_ps(0.5f - 1.0f / 16384);
        const auto near_half = [&](__m512 t, __m512 q) {
          return _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, q)), near, _CMP_GT_OQ);
        };
        if ((near_half(tlo, qlo) | near_half(thi, qhi)) != 0) {
          const __m512 sv = _mm512_set1_ps(scale[j]);
          qlo = _mm512_roundscale_ps(_mm512_div_ps(lo, sv), kEven);
          qhi = _mm512_roundscale_ps(_mm512_div_ps(hi, sv), kEven);
        }
      }
      fn(k0, qlo, qhi, d[j]);
    }
  }
}
#endif

// One row of x: each 32-block rounded through int8 (as reference.quantize_activations_int8:
// divide by the float32 scale, round half to even, multiply by the scale rounded to fp16),
// then to O (bf16 or float32).
template <typename T, typename O>
inline void round_row_int8(const T* x, int64_t K, O* out) {
  static_assert(std::is_same_v<O, BF16> || std::is_same_v<O, float>);
#if defined(CPU_CAPABILITY_AVX512)
  for_each_int8_block(x, K, [&](int64_t k0, __m512 qlo, __m512 qhi, float d) {
    qlo = _mm512_mul_ps(qlo, _mm512_set1_ps(d));
    qhi = _mm512_mul_ps(qhi, _mm512_set1_ps(d));
    if constexpr (std::is_same_v<O, float>) {
      _mm512_storeu_ps(out + k0, qlo);
      _mm512_storeu_ps(out + k0 + 16, qhi);
    } else {
#if defined(__AVX512BF16__)
      _mm512_storeu_si512(out + k0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(qhi, qlo)));
#else
      at::vec::convert_float_bfloat16(vec::F(qlo), vec::F(qhi)).store(out + k0);
#endif
    }
  });
  return;
#endif
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    float v[kBlock];
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = vec::to_float(x[k0 + i]);
      amax = std::max(amax, std::abs(v[i]));
    }
    const float scale = amax / 127.0f;
    const float d = vec::round_to<vec::Half>(scale);
    for (int i = 0; i < kBlock; ++i) {
      const float q = scale > 0.0f ? std::nearbyint(v[i] / scale) : 0.0f;
      out[k0 + i] = vec::from_float<O>(q * d);
    }
  }
}

// x [K] (float or BF16) into out [K] of O (bf16 or float32): rounded through int8 per
// 32-block when int8 (K a multiple of 32), else as is.
template <typename T, typename O>
inline void row_as(const T* x, int64_t K, bool int8, O* out) {
  if (int8) {
    round_row_int8(x, K, out);
  } else if constexpr (std::is_same_v<T, O>) {
    std::memcpy(static_cast<void*>(out), x, K * sizeof(O));
  } else {
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) out[k] = vec::from_float<O>(vec::to_float(x[k]));
  }
}

}  // namespace quant
PLUGSERVE_ISA_END
