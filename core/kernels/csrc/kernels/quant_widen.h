// GGML blocks widened to float32 or bf16 values in memory (included by the quantized kernels
// inside their ISA namespace, after quant_blocks.h): the dequantizer and the many-row paths.
// Weight k of a chunk is q[k] * g16[k / 16] + min32[k / 32] in float32 (a multiply, then an
// add: gguf.quants.dequantize's rounding), then rounded to the output type.
//
// The copies with AVX-512 widen 32 quants held in a register at a time (the 32-block formats
// never leave registers; the K-quants pass through the decoded chunk in L1) and round to bf16
// with vcvtne2ps2bf16 where the copy has AVX512-BF16; the others widen the decoded chunk with
// plain loops.
#pragma once

#include <cstdint>

PLUGSERVE_ISA_BEGIN
namespace quant {

#if defined(CPU_CAPABILITY_AVX512)
// 32 values q * scale + constant (scale s0 for the first 16, s1 for the others) to dst; no
// constant unless WithMin.
template <bool WithMin, typename T>
inline void widen32(__m256i q, float s0, float s1, float constant, T* dst) {
  __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), _mm512_set1_ps(s0));
  __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
      _mm512_set1_ps(s1));
  if constexpr (WithMin) {
    lo = _mm512_add_ps(lo, _mm512_set1_ps(constant));
    hi = _mm512_add_ps(hi, _mm512_set1_ps(constant));
  }
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, lo);
    _mm512_storeu_ps(dst + 16, hi);
  } else {
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
#else
    at::vec::convert_float_bfloat16(vec::F(lo), vec::F(hi)).store(dst);
#endif
  }
}
#endif

// Weights [k0, k0 + n) of a row of blocks (k0 a multiple of kChunk, n <= kChunk a multiple of
// the format's block) as T (float or BF16) at dst.
template <QuantFormat Fmt, typename T>
inline void widen_span(const uint8_t* row, int64_t k0, int64_t n, T* __restrict dst) {
#if defined(CPU_CAPABILITY_AVX512)
  const uint8_t* b = row + k0 / block_elems(Fmt) * block_bytes(Fmt);
  if constexpr (block_elems(Fmt) == kBlock) {
    for (int64_t j = 0; j < n / kBlock; ++j, b += block_bytes(Fmt)) {
      const float d = half_at(b);
      widen32<has_min(Fmt)>(small_block_q<Fmt>(b), d, d,
                            has_min(Fmt) ? half_at(b + 2) : 0.0f, dst + j * kBlock);
    }
  } else {
    Chunk c;
    decode_k<Fmt>(b, c);
    for (int64_t j = 0; j < kChunk / kBlock; ++j) {
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q + j * kBlock));
      widen32<has_min(Fmt)>(q, c.g16[2 * j], c.g16[2 * j + 1], c.min32[j], dst + j * kBlock);
    }
  }
#else
  Chunk c;
  decode_chunk<Fmt>(row, k0, n, c);
  for (int64_t g = 0; g < n / 16; ++g) {
    const float scale = c.g16[g], constant = c.min32[g / 2];
    alignas(64) float wf[16];
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i)
      wf[i] = static_cast<float>(c.q[g * 16 + i]) * scale + constant;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst + g * 16, wf, sizeof(wf));
    } else {
      for (int64_t i = 0; i < 16; i += vec::kWidth)
        vec::store(dst + g * 16 + i, vec::F::loadu(wf + i));
    }
  }
#endif
}

// A whole row of K weights as T.
template <QuantFormat Fmt, typename T>
inline void widen_row(const uint8_t* row, int64_t K, T* __restrict dst) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk)
    widen_span<Fmt, T>(row, k0, std::min(kChunk, K - k0), dst + k0);
}

}  // namespace quant
PLUGSERVE_ISA_END
