// Rows of x rounded through int8 per 32-block (llama.cpp's activations for integer dot
// products), with the per-block figures the few-row int8 kernels scale by (included by
// quant_linear.cpp inside its ISA namespace, after quant_blocks.h).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

PLUGSERVE_ISA_BEGIN
namespace quant {

struct Int8Rows {
  int64_t K = 0;
  std::vector<int8_t> q;           // [M, K]
  std::vector<float> lane_scale;   // [M, K / 4]: dx of each 4-weight lane (its block's)
  std::vector<float> block_scale;  // [M, K / 32]: dx, the fp16-rounded scale of the block
  std::vector<float> block_sum;    // [M, K / 32]: dx * sum(xq)
  std::vector<float> scale_sum;    // [M, K / 32, 2]: dx, dx * sum(xq)
  std::vector<float> sum16;        // [M, K / 16]: sum(xq) of each 16 (exact in float)
};

// The 32 whole numbers in v (|v| <= 127) as int8 into q, and the sums of each 16 of them.
inline void to_int8_summed(const float* v, int8_t* q, int sums[2]) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int h = 0; h < 2; ++h) {
    const __m512i i = _mm512_cvttps_epi32(_mm512_load_ps(v + 16 * h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(i));
    sums[h] = _mm512_reduce_add_epi32(i);
  }
#elif defined(__AVX2__)
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvttps_epi32(_mm256_load_ps(v + 8 * k));
  // packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  for (int h = 0; h < 2; ++h) {
    const __m256i s8 = _mm256_add_epi32(i[2 * h], i[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sums[h] = _mm_cvtsi128_si32(s4);
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      q[i] = static_cast<int8_t>(v[i]);
      sums[h] += q[i];
    }
#endif
}

// x's rows rounded into r, whose vectors are resized (kept when r held this many rows
// before: a decode step's calls reuse one per thread instead of allocating six).
template <typename T>
void quantize_rows_into(const T* x, int64_t x_stride, int64_t M, int64_t K, Int8Rows& r) {
  const int64_t blocks = K / kBlock;
  r.K = K;
  r.q.resize(M * K);
  r.lane_scale.resize(M * K / 4);
  r.block_scale.resize(M * blocks);
  r.block_sum.resize(M * blocks);
  r.scale_sum.resize(M * blocks * 2);
  r.sum16.resize(M * K / 16);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * x_stride;
    for (int64_t b = 0; b < blocks; ++b) {
      // As reference.quantize_activations_int8: divide by the float32 scale, round half to
      // even, keep the scale rounded to fp16 (in vectors: the division is the exact one).
      alignas(64) float v[kBlock];
      vec::F amax_v(0.0f);
      for (int64_t i = 0; i < kBlock; i += vec::kWidth) {
        const vec::F t = vec::load(row + b * kBlock + i);
        t.store(v + i);
        amax_v = at::vec::maximum(amax_v, t.abs());
      }
      const float scale = vec::hmax(amax_v) / 127.0f;
      if (scale > 0.0f) {
        const vec::F s(scale);
        for (int64_t i = 0; i < kBlock; i += vec::kWidth)
          (vec::F::loadu(v + i) / s).round().store(v + i);
      } else {
        std::fill_n(v, kBlock, 0.0f);
      }
      int8_t* q = r.q.data() + m * K + b * kBlock;
      int sums[2] = {0, 0};
      to_int8_summed(v, q, sums);
      const float d = vec::round_to<vec::Half>(scale);
      const int64_t mb = m * blocks + b;
      for (int64_t l = 0; l < kBlock / 4; ++l) r.lane_scale[mb * (kBlock / 4) + l] = d;
      const float sum = d * static_cast<float>(sums[0] + sums[1]);
      r.block_scale[mb] = d;
      r.block_sum[mb] = sum;
      r.scale_sum[2 * mb] = d;
      r.scale_sum[2 * mb + 1] = sum;
      r.sum16[2 * mb] = static_cast<float>(sums[0]);
      r.sum16[2 * mb + 1] = static_cast<float>(sums[1]);
    }
  }
}


// Row m0 of an Int8Rows and the M - 1 after it, as the few-row kernels read them.
struct XRows {
  const int8_t* q;
  const float* block_scale;
  const float* block_sum;
  const float* scale_sum;
  const float* sum16;
  int64_t K;
  int64_t blocks;

  XRows(const Int8Rows& r, int64_t m0)
      : q(r.q.data() + m0 * r.K), block_scale(r.block_scale.data() + m0 * (r.K / kBlock)),
        block_sum(r.block_sum.data() + m0 * (r.K / kBlock)),
        scale_sum(r.scale_sum.data() + m0 * (r.K / kBlock) * 2),
        sum16(r.sum16.data() + m0 * (r.K / 16)), K(r.K), blocks(r.K / kBlock) {}
};

}  // namespace quant
PLUGSERVE_ISA_END
