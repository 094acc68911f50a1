// The register tiles of the CPU prefill attention (kernels/prefill_attention.cpp): the
// scores of a block of query rows against panels of packed keys, the probabilities times
// the packed values, and the online-softmax step in vectors. The accumulators are arrays of
// Reg indexed by compile-time constants in fully unrolled loops, which GCC keeps in
// registers. Tiles are kTileRows rows x kTileCols vectors (AVX-512: 6 x 4; AVX2 and the
// scalar copy: 6 x 2, to fit 16 registers); `tiles` covers any rows and columns with them
// and smaller ones. In the avx512_bf16 copy, vdpbf16ps tiles take bf16 queries, keys,
// probabilities and values (layouts in prefill_attention.cpp).
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace prefill {
// Internal linkage, as in the one file that includes this: the same inlining as before.
namespace {

using namespace vec;

constexpr int64_t kPanel = kWidth;  // keys per packed K panel: one vector of float32 scores
constexpr int kTileRows = 6;        // rows per register tile
constexpr int kTileCols = kRegisters >= 32 ? 4 : 2;  // vectors per register tile row
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// s[r][kPanel j : kPanel (j + 1)] = q_r . (panel j) for r < MR, j < NB.
template <int MR, int NB>
inline void scores_tile(const float* q, int64_t D, const float* kp, float* s, int64_t s_stride) {
  Reg acc[MR][NB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = F(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    Reg kv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) kv[j] = F::loadu(kp + j * D * kPanel + d * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const F qb(q[r * D + d]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = fmadd(qb, kv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) F(acc[r][j]).store(s + r * s_stride + j * kPanel);
}

// o[r][0 : kWidth NV] += sum_j p[r][j] * v[j][0 : kWidth NV] for r < MR (v and o offset to
// the dims).
template <int MR, int NV>
inline void values_tile(const float* p, int64_t p_stride, int64_t keys, const float* v,
                        int64_t D, float* o) {
  Reg acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = F::loadu(o + r * D + kWidth * c);
  for (int64_t j = 0; j < keys; ++j) {
    Reg vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = F::loadu(v + j * D + kWidth * c);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const F pb(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = fmadd(pb, vv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) F(acc[r][c]).store(o + r * D + kWidth * c);
}

// Tile<MR, N>::run(args, r, c) over `rows` rows in tiles of kTileRows and one smaller tile,
// and over n vectors in groups of kTileCols and one smaller group: the tile shapes are
// template arguments.
template <template <int, int> class Tile, int MR, typename Args>
inline void columns(const Args& args, int64_t r, int64_t n) {
  int64_t c = 0;
  for (; c + kTileCols <= n; c += kTileCols) Tile<MR, kTileCols>::run(args, r, c);
  switch (n - c) {
    case 3: if constexpr (kTileCols > 3) Tile<MR, 3>::run(args, r, c); break;
    case 2: if constexpr (kTileCols > 2) Tile<MR, 2>::run(args, r, c); break;
    case 1: Tile<MR, 1>::run(args, r, c); break;
    default: break;
  }
}

template <template <int, int> class Tile, typename Args>
inline void tiles(const Args& args, int64_t rows, int64_t n) {
  static_assert(kTileRows == 6, "the remainder cases below");
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) columns<Tile, kTileRows>(args, r, n);
  switch (rows - r) {
    case 5: columns<Tile, 5>(args, r, n); break;
    case 4: columns<Tile, 4>(args, r, n); break;
    case 3: columns<Tile, 3>(args, r, n); break;
    case 2: columns<Tile, 2>(args, r, n); break;
    case 1: columns<Tile, 1>(args, r, n); break;
    default: break;
  }
}

template <typename QK>
struct ScoreArgs {
  const QK* q;     // the task's query rows, [rows][D]
  int64_t D;
  const QK* kp;    // the block's first K panel
  float* s;        // scores, [rows][s_stride]
  int64_t s_stride;
};

template <typename PV>
struct ValueArgs {
  const PV* p;     // probabilities, [rows][p_stride]
  int64_t p_stride;
  int64_t keys;
  const PV* v;     // the block's V (layout per path)
  int64_t D;
  float* o;        // accumulators, [rows][D]
};

template <int MR, int NB>
struct ScoresF32 {
  static void run(const ScoreArgs<float>& a, int64_t r, int64_t pn) {
    scores_tile<MR, NB>(a.q + r * a.D, a.D, a.kp + pn * a.D * kPanel,
                        a.s + r * a.s_stride + pn * kPanel, a.s_stride);
  }
};

template <int MR, int NV>
struct ValuesF32 {
  static void run(const ValueArgs<float>& a, int64_t r, int64_t c) {
    values_tile<MR, NV>(a.p + r * a.p_stride, a.p_stride, a.keys, a.v + kWidth * c, a.D,
                        a.o + r * a.D + kWidth * c);
  }
};

// The online-softmax step of softmax_plain in vectors (n a multiple of kWidth, D too), in
// base 2: m is kept as max(s * scale * log2 e), so one FMA per vector takes a raw score to
// the exponent. P is float (stored as is) or uint16_t (rounded to bf16, avx512_bf16 copy
// only; the sum then adds the rounded values, so that the output is the weighted mean with
// the weights it used).
template <typename P>
inline void softmax_vec(const float* s, P* prob, int64_t n, int64_t vis0, int64_t vis1,
                        float scale, float& m, float& l, float* o, int64_t D) {
  const bool all = vis0 == 0 && vis1 == n;
  if (vis0 >= vis1) {
    std::memset(prob, 0, n * sizeof(P));
    return;
  }
  const float c = scale * 1.4426950408889634f;
  const F vc(c), lo(static_cast<float>(vis0)), hi(static_cast<float>(vis1));
  // Lanes j .. j + kWidth - 1 of the block that lie in [vis0, vis1): all bits set.
  const auto visible = [&](int64_t j) {
    const F idx = F::arange(static_cast<float>(j), 1.0f);
    return (idx >= lo) & (idx < hi);
  };
  F vmax(kNegInf);
  for (int64_t j = 0; j < n; j += kWidth) {
    const F t = F::loadu(s + j) * vc;
    vmax = max_no_nan(all ? t : F::blendv(F(kNegInf), t, visible(j)), vmax);
  }
  const float m_new = std::max(m, hmax(vmax));
  // The first block a row sees has m = -inf and zero accumulators and sum: alpha is moot.
  const float alpha = m == kNegInf ? 0.f : std::exp2(m - m_new);
  const F vm(m_new);
  F vsum(0.0f);
  for (int64_t j = 0; j < n; j += kWidth) {
    // Masked lanes are computed like the others and then zeroed: their scores do not matter.
    F e = vec::exp2(at::vec::fmsub(F::loadu(s + j), vc, vm));
    if (!all) e = e & visible(j);
    if constexpr (std::is_same_v<P, float>) {
      e.store(prob + j);
    } else {
#if defined(__AVX512BF16__)
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + j), bits);
      e = F(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#endif
    }
    vsum = vsum + e;
  }
  if (alpha != 1.f) {
    const F va(alpha);
    for (int64_t d = 0; d < D; d += kWidth) (F::loadu(o + d) * va).store(o + d);
  }
  l = l * alpha + hsum(vsum);
  m = m_new;
}

#if defined(__AVX512BF16__)
// s[r][16 j : 16 j + 16] = q_r . (panel j) with vdpbf16ps: each step adds the products of
// two dims (a broadcast pair of the query row) for 16 keys. D % 2 == 0.
template <int MR, int NB>
inline void scores_tile_bf16(const uint16_t* q, int64_t D, const uint16_t* kp, float* s,
                             int64_t s_stride) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m512bh kv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      kv[j] = (__m512bh)_mm512_loadu_si512(kp + j * D * kPanel + dp * 2 * kPanel);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * D + 2 * dp, sizeof(pair));
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qb, kv[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(s + r * s_stride + j * kPanel, acc[r][j]);
}

// o[r][0 : 16 NV] += sum_j p[r][j] * v_j[0 : 16 NV] with vdpbf16ps over pairs of keys: p is
// bf16 [MR][p_stride], v the pairs layout [keys / 2][D][2] offset to the dims.
template <int MR, int NV>
inline void values_tile_bf16(const uint16_t* p, int64_t p_stride, int64_t keys,
                             const uint16_t* v, int64_t D, float* o) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int64_t jp = 0; jp < keys / 2; ++jp) {
    __m512bh vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      vv[c] = (__m512bh)_mm512_loadu_si512(v + (jp * D + 16 * c) * 2);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * p_stride + 2 * jp, sizeof(pair));
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

template <int MR, int NB>
struct ScoresBf16 {
  static void run(const ScoreArgs<uint16_t>& a, int64_t r, int64_t pn) {
    scores_tile_bf16<MR, NB>(a.q + r * a.D, a.D, a.kp + pn * a.D * kPanel,
                             a.s + r * a.s_stride + pn * kPanel, a.s_stride);
  }
};

template <int MR, int NV>
struct ValuesBf16 {
  static void run(const ValueArgs<uint16_t>& a, int64_t r, int64_t c) {
    values_tile_bf16<MR, NV>(a.p + r * a.p_stride, a.p_stride, a.keys, a.v + 32 * c, a.D,
                             a.o + r * a.D + 16 * c);
  }
};
#endif  // __AVX512BF16__

}  // namespace
}  // namespace prefill
PLUGSERVE_ISA_END
