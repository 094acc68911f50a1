// Rows of x rounded through int8 per 32-block (llama.cpp's activations for integer dot
// products), with the per-block figures the few-row int8 kernels scale by (included by
// quant_linear.cpp inside its ISA namespace, after quant_blocks.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

PLUGSERVE_ISA_BEGIN
namespace quant {

// What a row of x contributes, beyond its int8 quants, to a block's dot product with weights
// q * d + c: d * dx * dot(q, xq) + c * dx * sum(xq). x_sum_factor(F) is the constant c / d
// the 4- and 5-bit formats without a min apply through the unsigned quants (q - 8, q - 16),
// 1 for the others (whose c comes from the block).
constexpr float x_sum_factor(QuantFormat f) {
  return f == QuantFormat::q4_0 ? -8.0f : f == QuantFormat::q5_0 ? -16.0f : 1.0f;
}

struct Int8Rows {
  int64_t K = 0;
  std::vector<int8_t> q;           // [M, K]
  std::vector<float> lane_scale;   // [M, K / 4]: dx of each 4-weight lane (its block's)
  std::vector<float> block_scale;  // [M, K / 32]: dx, the fp16-rounded scale of the block
  std::vector<float> block_sum;    // [M, K / 32]: dx * sum(xq)
  std::vector<float> scale_sum;    // [M, K / 32, 2]: dx, x_sum_factor * dx * sum(xq)
  std::vector<float> sum16;        // [M, K / 16]: sum(xq) of each 16 (exact in float)
};

template <typename T>
Int8Rows quantize_rows(const T* x, int64_t x_stride, int64_t M, int64_t K, float sum_factor) {
  Int8Rows r;
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
      float v[kBlock];
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        v[i] = vec::to_float(row[b * kBlock + i]);
        amax = std::max(amax, std::abs(v[i]));
      }
      // As reference.quantize_activations_int8: divide by the float32 scale, round half to
      // even, keep the scale rounded to fp16.
      const float scale = amax / 127.0f;
      int8_t* q = r.q.data() + m * K + b * kBlock;
      int sums[2] = {0, 0};
      for (int i = 0; i < kBlock; ++i) {
        const float t = scale > 0.0f ? std::nearbyint(v[i] / scale) : 0.0f;
        q[i] = static_cast<int8_t>(t);
        sums[i / 16] += q[i];
      }
      const float d = vec::round_to<vec::Half>(scale);
      const int64_t mb = m * blocks + b;
      for (int64_t l = 0; l < kBlock / 4; ++l) r.lane_scale[mb * (kBlock / 4) + l] = d;
      const float sum = d * static_cast<float>(sums[0] + sums[1]);
      r.block_scale[mb] = d;
      r.block_sum[mb] = sum;
      r.scale_sum[2 * mb] = d;
      r.scale_sum[2 * mb + 1] = sum_factor * sum;
      r.sum16[2 * mb] = static_cast<float>(sums[0]);
      r.sum16[2 * mb + 1] = static_cast<float>(sums[1]);
    }
  }
  return r;
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
