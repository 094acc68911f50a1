// What the integer many-row kernels (quant_vnni.cpp on AVX512-VNNI, quant_maddubs.cpp on
// AVX2) share: x's int8 quants packed a vector of rows at a time (PackedX), and panels of
// weight rows decoded for them: each row's quants as bytes plus a shift that makes
// them unsigned (the byte operand the instructions take unsigned), a scale per group of G
// weights (16 for Q6_K, whose scales are per 16, else 32) and each 32-block's constant, kept
// in L1 / L2 while every tile of x's rows runs over them. Included after quant_blocks.h
// inside the ISA namespace of the copies with AVX2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

PLUGSERVE_ISA_BEGIN
#if defined(__AVX2__)
namespace quant {

constexpr int64_t kPanelRows = 48;  // weight rows decoded at a time

// Weights per scale: Q6_K's scales are per 16, the other formats' per 32.
constexpr int group_of(QuantFormat f) { return f == QuantFormat::q6_k ? 16 : 32; }

// x rounded through int8 and packed for the tiles, Lanes rows a vector (rows past M: zero
// quants and scales). The kernel fills it; init sizes it.
template <int64_t Lanes>
struct PackedX {
  int64_t vectors = 0, K = 0, blocks = 0, groups = 0;
  std::vector<int8_t> q;     // [vectors][K / 4][Lanes][4]
  std::vector<float> scale;  // [vectors][blocks][Lanes]: dx
  std::vector<float> sum;    // [vectors][blocks][Lanes]: dx * sum of the block's quants
  std::vector<int32_t> neg;  // [vectors][groups][Lanes]: -(sum of the group's quants)

  void init(int64_t M, int64_t K_, int64_t G) {
    K = K_;
    blocks = K / kBlock;
    groups = K / G;
    vectors = (M + Lanes - 1) / Lanes;
    q.resize(vectors * K * Lanes);
    scale.assign(vectors * blocks * Lanes, 0.0f);
    sum.assign(vectors * blocks * Lanes, 0.0f);
    neg.assign(vectors * groups * Lanes, 0);
  }
  const int8_t* q_at(int64_t v) const { return q.data() + v * K * Lanes; }
  const float* scale_at(int64_t v) const { return scale.data() + v * blocks * Lanes; }
  const float* sum_at(int64_t v) const { return sum.data() + v * blocks * Lanes; }
  const int32_t* neg_at(int64_t v) const { return neg.data() + v * groups * Lanes; }
};

// The R x-vectors from v0 that a tile multiplies: where each one's quants, scales, sums and
// negated group sums start.
template <int64_t Lanes, int R>
struct XVectors {
  const int8_t* q[R];
  const float* scale[R];
  const float* sum[R];
  const int32_t* neg[R];

  XVectors(const PackedX<Lanes>& x, int64_t v0) {
    for (int r = 0; r < R; ++r) {
      q[r] = x.q_at(v0 + r);
      scale[r] = x.scale_at(v0 + r);
      sum[r] = x.sum_at(v0 + r);
      neg[r] = x.neg_at(v0 + r);
    }
  }
};

// A panel of weight rows (rows past N are zero: they add nothing).
struct Panel {
  std::vector<uint8_t> q;  // [kPanelRows][K] quants + the shift (with Abs: |quants|)
  std::vector<int8_t> s;   // [kPanelRows][K] with Abs: the quants themselves (their signs)
  std::vector<float> g;    // [kPanelRows][K / G] each group's scale
  std::vector<float> c;    // [kPanelRows][K / 32] each 32-block's constant
};

// Weight rows n0 .. n0 + kPanelRows of w into p, each quant plus `Shift` (a byte); with
// `Abs` (Q8_0 on AVX2, Shift 0) the quants' absolute values, and the quants into p.s.
template <QuantFormat Fmt, int G, int Shift, bool Abs = false>
void decode_panel(const uint8_t* w, int64_t w_row_bytes, int64_t K, int64_t N, int64_t n0,
                  Panel& p) {
  const int64_t groups = K / G, blocks = K / kBlock;
  const int64_t rows = std::min(kPanelRows, N - n0);
  const __m256i shift = _mm256_set1_epi8(static_cast<char>(Shift));
  p.q.resize(kPanelRows * K);
  p.g.resize(kPanelRows * groups);
  p.c.resize(kPanelRows * blocks);
  static_assert(!Abs || (Shift == 0 && block_elems(Fmt) == kBlock), "Abs: signed small blocks");
  if constexpr (Abs) p.s.resize(kPanelRows * K);
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* row = w + (n0 + n) * w_row_bytes;
    uint8_t* q = p.q.data() + n * K;
    float* g = p.g.data() + n * groups;
    float* c = p.c.data() + n * blocks;
    if constexpr (block_elems(Fmt) == kBlock) {
      for (int64_t j = 0; j < blocks; ++j) {
        const uint8_t* b = row + j * block_bytes(Fmt);
        const __m256i v = small_block_q<Fmt>(b);
        if constexpr (Abs) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.s.data() + n * K + j * kBlock), v);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j * kBlock), _mm256_abs_epi8(v));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j * kBlock),
                              _mm256_add_epi8(v, shift));
        }
        g[j] = half_at(b);
        c[j] = has_min(Fmt) ? half_at(b + 2) : 0.0f;
      }
    } else {
      Chunk chunk;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        decode_k<Fmt>(row + k0 / kChunk * block_bytes(Fmt), chunk);
        for (int64_t j = 0; j < kChunk; j += 32) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(chunk.q + j));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0 + j), _mm256_add_epi8(v, shift));
        }
        for (int64_t j = 0; j < kChunk / G; ++j) g[k0 / G + j] = chunk.g16[j * G / 16];
        for (int64_t j = 0; j < kChunk / kBlock; ++j) c[k0 / kBlock + j] = chunk.min32[j];
      }
    }
  }
  for (int64_t n = rows; n < kPanelRows; ++n) {
    std::memset(p.q.data() + n * K, 0, K);
    if constexpr (Abs) std::memset(p.s.data() + n * K, 0, K);
    std::fill_n(p.g.data() + n * groups, groups, 0.0f);
    std::fill_n(p.c.data() + n * blocks, blocks, 0.0f);
  }
}

inline int32_t dword_at(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace quant
#endif
PLUGSERVE_ISA_END
