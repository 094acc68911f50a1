// The many-row quantized linear with int8 activations on AVX2 (no VNNI, no AMX): out =
// x_int8 @ dequantize(w).T with integer products (vpmaddubsw: 32 byte products into 16
// pairwise int16 sums an instruction; vpmaddwd widens them to int32), for a decode batch's
// rows and a prefill's, where the dequantize-and-GEMM path writes and reads every weight in
// float32 first.
//
// x [M, K] is rounded through int8 per 32-block as the few-row kernels round it
// (quant_x_int8.h) and packed once per call, 8 rows a vector: [M / 8][K / 4][8 rows][4]
// signed bytes (8 x 8 transposes of 4-byte groups), with each 32-block's scale dx,
// dx * sum(q) and each group's -sum(q) as vectors over the 8 rows. Each task takes panels of
// kPanelRows weight rows, decoded (quant_panel.h) into bytes with a scale per group of G
// weights and each 32-block's constant; then every tile of kTileVectors x-vectors x J weight
// rows runs over K: per step of 4 weights, x's packed bytes times a weight row's 4 bytes
// broadcast. vpmaddubsw multiplies unsigned by signed bytes and saturates its pairwise sums
// at int16, so:
// - the formats without a constant are shifted to unsigned bytes (Q4_0 by 8, Q5_0 by 16, Q6_K
//   by 32; the shift is taken back out of the integer sums through each group's -sum(xq)),
//   except Q8_0, whose quants (-128..127) shifted by 128 would overflow the pairs: it
//   multiplies |w| by x with w's sign (vpsignb; llama.cpp's trick), |w| <= 128 and |xq| <= 127
//   keeping a pair within 2 * 128 * 127 = 32,512 (the panel holds |w| and w, so a step
//   broadcasts both instead of taking the absolute value of each);
// - the int16 pairs of several steps are added before they are widened, as many as cannot
//   overflow: a weight byte of at most 15 (4-bit) lets a whole 32-group's 8 steps add up
//   (8 x 2 x 15 x 127 = 30,480), 31 (5-bit) 4 steps, 63 (Q6_K) 2, Q8_0 one.
// The int32 sums of each group are exact; they are scaled into float32 sums, sum +=
// float(int) * (g * dx) (+ c * dx * sum(xq) for the formats with a constant): the few-row
// kernel's arithmetic and the VNNI kernel's. A tile's sums are vectors over x's rows, so each
// panel's results are transposed 8 x 8 into out (rows of N), with the bias.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <type_traits>
#include <vector>

#include "../vec/pvec.h"
#include "quant_blocks.h"
#include "quant_panel.h"
#include "quant_x_int8.h"

PLUGSERVE_ISA_BEGIN

#if defined(__AVX2__)
namespace {

using quant::dword_at;
using quant::group_of;
using quant::kBlock;
using quant::kPanelRows;
using quant::Panel;

constexpr int64_t kLanes = 8;    // rows of x per vector of int32 sums
constexpr int kTileVectors = 2;  // x-vectors per tile (16 rows)

// What a format's quants are shifted by to be unsigned bytes (Q8_0: none, signed with vpsignb).
constexpr int shift_of(QuantFormat f) {
  return f == QuantFormat::q4_0 ? 8 : f == QuantFormat::q5_0 ? 16 : f == QuantFormat::q6_k ? 32
                                                                                              : 0;
}
// The largest weight byte vpmaddubsw sees (Q8_0: |w|).
constexpr int max_byte_of(QuantFormat f) {
  return f == QuantFormat::q8_0 ? 128
       : f == QuantFormat::q6_k ? 63
       : (f == QuantFormat::q5_0 || f == QuantFormat::q5_1 || f == QuantFormat::q5_k) ? 31
                                                                                         : 15;
}
// Steps of 4 weights whose int16 pairs add up without overflow (x's quants: |xq| <= 127).
constexpr int int16_steps_of(QuantFormat f) {
  const int fit = 32767 / (2 * max_byte_of(f) * 127);
  return std::min(fit, group_of(f) / 4);
}
// Weight rows per tile: the int16 and int32 sums of J x kTileVectors and the operands fit the
// 16 vector registers; where a group's sums widen more than once both kinds stay live, and
// Q8_0's products need a register for x with w's sign.
constexpr int tile_rows_of(QuantFormat f) {
  return f == QuantFormat::q8_0 ? 3 : int16_steps_of(f) == group_of(f) / 4 ? 4 : 2;
}

// 8 vectors of 8 32-bit values: r[i] becomes column i of the 8 x 8 matrix the rows made.
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

using PackedX = quant::PackedX<kLanes>;

template <typename T>
void pack_x(const QuantGemmArgs& a, int64_t G, PackedX& p) {
  p.init(a.M, a.K, G);
  const T* x = static_cast<const T*>(a.x);
  at::parallel_for(0, p.vectors, 1, [&](int64_t begin, int64_t end) {
    quant::Int8Rows r;
    for (int64_t v = begin; v < end; ++v) {
      const int64_t m0 = v * kLanes, rows = std::min(kLanes, a.M - m0);
      quant::quantize_rows_into(x + m0 * a.x_stride, a.x_stride, rows, a.K, r);
      float* scale = p.scale.data() + v * p.blocks * kLanes;
      float* sum = p.sum.data() + v * p.blocks * kLanes;
      int32_t* neg = p.neg.data() + v * p.groups * kLanes;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t b = 0; b < p.blocks; ++b) {
          scale[b * kLanes + i] = r.block_scale[i * p.blocks + b];
          sum[b * kLanes + i] = r.block_sum[i * p.blocks + b];
        }
        // sum16 holds each 16's sum of quants, whole numbers, exact in float
        const float* s16 = r.sum16.data() + i * (a.K / 16);
        for (int64_t g = 0; g < p.groups; ++g) {
          neg[g * kLanes + i] = G == 16 ? -static_cast<int32_t>(s16[g])
                                        : -static_cast<int32_t>(s16[2 * g] + s16[2 * g + 1]);
        }
      }
      // [8 rows][K] -> [K / 4][8 rows][4]; rows past M are zero quants.
      int8_t* packed = p.q.data() + v * a.K * kLanes;
      for (int64_t k = 0; k < a.K; k += 32) {
        __m256i t[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) {
          t[i] = i < rows ? _mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(r.q.data() + i * a.K + k))
                          : _mm256_setzero_si256();
        }
        transpose8(t);
        for (int64_t j = 0; j < kLanes; ++j) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + (k / 4 + j) * 32), t[j]);
        }
      }
    }
  });
}

// The float32 sums of R x-vectors (from v0) times J panel rows (from n), over all K, into
// t[row][R * 8] (row-major over the panel's rows, lanes over x's rows). The float sums stay in
// t (L1), updated once per group, so the int16 and int32 sums keep the registers.
template <QuantFormat Fmt, int J, int R>
void tile(const PackedX& x, int64_t v0, const Panel& p, int64_t n, float* t) {
  constexpr int G = group_of(Fmt), kShift = shift_of(Fmt), kSteps = int16_steps_of(Fmt);
  constexpr bool kSigned = Fmt == QuantFormat::q8_0, kMin = quant::has_min(Fmt);
  static_assert((G / 4) % kSteps == 0, "the int16 runs divide a group");
  static_assert(kShift == 0 || (kShift & (kShift - 1)) == 0, "a power of two");
  constexpr int kShiftBits = kShift == 0 ? 0 : __builtin_ctz(kShift);
  const int64_t K = x.K, groups = K / G, blocks = x.blocks;
  const quant::XVectors<kLanes, R> xv_at(x, v0);
  const auto& xq = xv_at.q;
  const auto& xs = xv_at.scale;
  const auto& xsum = xv_at.sum;
  const auto& xneg = xv_at.neg;
  const uint8_t* wq = p.q.data() + n * K;
  const int8_t* wsign = kSigned ? p.s.data() + n * K : nullptr;  // Q8_0: |w| in wq
  const float* wg = p.g.data() + n * groups;
  const float* wc = p.c.data() + n * blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  std::fill_n(t, J * R * kLanes, 0.0f);
  for (int64_t b = 0; b < groups; ++b) {
    __m256i sums[J][R];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) sums[j][r] = _mm256_setzero_si256();
    for (int s0 = 0; s0 < G / 4; s0 += kSteps) {
      __m256i part[J][R];
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j)
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) part[j][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int s = 0; s < kSteps; ++s) {
        const int64_t k4 = b * (G / 4) + s0 + s;
        __m256i xv[R];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r)
          xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + k4 * 32));
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) {
          const __m256i wu = _mm256_set1_epi32(dword_at(wq + j * K + 4 * k4));
          __m256i ws = wu;
          if constexpr (kSigned) {
            ws = _mm256_set1_epi32(
                dword_at(reinterpret_cast<const uint8_t*>(wsign) + j * K + 4 * k4));
          }
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) {
            const __m256i xr = kSigned ? _mm256_sign_epi8(xv[r], ws) : xv[r];
            part[j][r] = _mm256_add_epi16(part[j][r], _mm256_maddubs_epi16(wu, xr));
          }
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j)
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r)
          sums[j][r] = _mm256_add_epi32(sums[j][r], _mm256_madd_epi16(part[j][r], ones));
    }
    // sum (q + shift) * xq over the group + shift * (-sum(xq)) is sum q * xq exactly.
    if constexpr (kShift != 0) {
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256i back = _mm256_slli_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xneg[r] + b * kLanes)),
            kShiftBits);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) sums[j][r] = _mm256_add_epi32(sums[j][r], back);
      }
    }
    // t += float(sum) * (g * dx), then + c * dx * sum(xq) for the formats with a constant
    // (G == 32 for them: one constant per group).
    const int64_t blk = b * G / kBlock;
    __m256 dx[R], sx[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      dx[r] = _mm256_loadu_ps(xs[r] + blk * kLanes);
      if constexpr (kMin) sx[r] = _mm256_loadu_ps(xsum[r] + blk * kLanes);
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      const __m256 g = _mm256_set1_ps(wg[j * groups + b]);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        float* acc = t + (j * R + r) * kLanes;
        __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j][r]), _mm256_mul_ps(g, dx[r]),
                                   _mm256_loadu_ps(acc));
        if constexpr (kMin) a = _mm256_fmadd_ps(_mm256_set1_ps(wc[j * blocks + blk]), sx[r], a);
        _mm256_storeu_ps(acc, a);
      }
    }
  }
}

// 8 floats as bf16, rounded to nearest even, NaN as 0x7FC0 (c10::BFloat16's rounding).
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The panel's sums t [kPanelRows][lanes] (lanes: 8 or 16) for x's rows m0 .. m0 + rows, into
// out with the bias, transposed 8 x 8 at a time.
template <typename TO>
void store_panel(const QuantGemmArgs& a, const float* t, int64_t lanes, int64_t m0,
                 int64_t rows, int64_t n0) {
  const int64_t cols = std::min(kPanelRows, a.N - n0);
  TO* out = static_cast<TO*>(a.out);
  alignas(32) TO y[kLanes];
  for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
    const int64_t n = std::min(kLanes, cols - c0);
    alignas(32) float bias[kLanes] = {};
    if (a.bias != nullptr) std::copy_n(a.bias + n0 + c0, n, bias);
    const __m256 bias_v = _mm256_load_ps(bias);
    for (int64_t l0 = 0; l0 < rows; l0 += kLanes) {
      __m256i r[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        r[i] = _mm256_castps_si256(_mm256_loadu_ps(t + (c0 + i) * lanes + l0));
      transpose8(r);
      for (int64_t i = 0; i < std::min(kLanes, rows - l0); ++i) {
        const __m256 v = _mm256_add_ps(_mm256_castsi256_ps(r[i]), bias_v);
        TO* dst = out + (m0 + l0 + i) * a.N + n0 + c0;
        TO* to = n == kLanes ? dst : y;
        if constexpr (std::is_same_v<TO, float>) {
          _mm256_storeu_ps(to, v);
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(to), to_bf16(v));
        }
        if (n < kLanes) std::copy_n(y, n, dst);
      }
    }
  }
}

template <QuantFormat Fmt, typename TO>
void panels(const QuantGemmArgs& a, const PackedX& x, int64_t begin, int64_t end) {
  constexpr int G = group_of(Fmt), J = tile_rows_of(Fmt);
  static_assert(kPanelRows % J == 0, "tiles cover a panel");
  Panel p;
  std::vector<float> t(kPanelRows * kTileVectors * kLanes);
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n0 = pi * kPanelRows;
    quant::decode_panel<Fmt, G, shift_of(Fmt), Fmt == QuantFormat::q8_0>(a.w, a.w_row_bytes,
                                                                         a.K, a.N, n0, p);
    for (int64_t v = 0; v < x.vectors; v += kTileVectors) {
      const int64_t vs = std::min<int64_t>(kTileVectors, x.vectors - v);
      for (int64_t n = 0; n < kPanelRows; n += J) {
        float* tn = t.data() + n * vs * kLanes;
        if (vs == 2) {
          tile<Fmt, J, 2>(x, v, p, n, tn);
        } else {
          tile<Fmt, J, 1>(x, v, p, n, tn);
        }
      }
      const int64_t m0 = v * kLanes;
      store_panel<TO>(a, t.data(), vs * kLanes, m0, std::min(vs * kLanes, a.M - m0), n0);
    }
  }
}

template <QuantFormat Fmt, typename TO>
void run(const QuantGemmArgs& a, const PackedX& x) {
  const int64_t count = (a.N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    panels<Fmt, TO>(a, x, begin, end);
  });
}

}  // namespace

bool maddubs_usable() { return true; }

// Where "auto" takes this kernel. Measured on the Cascade Lake class Xeon (2 threads,
// benchmarks/quant_linear_speed.py --many 16,64,128,1024 --kernels maddubs / strips, ms per
// call, 1536 x 576): on the avx2 copy against oneDNN held to AVX2, Q4_1 0.20 / 0.64 / 1.28 /
// 10.4 against 0.51 / 1.22 / 2.06 / 12.7, Q8_0 0.28 / 0.94 / 2.0 / 14.6 against 0.88 / 1.28 /
// 2.0 / 12.8 (Q8_0's products take three instructions per 32, float32 FMAs two per 16: past a
// decode batch the float32 GEMM of dequantized strips catches up); on an AVX-512 copy against
// oneDNN's AVX-512 float32 GEMM, 256-bit integer products lose from 64 rows on (Q4_1 1.38 /
// 2.58 / 19.4 against 1.71 / 2.16 / 12.2), so the copies with AVX-512 leave it to VNNI or
// strips.
bool maddubs_auto(QuantFormat format, int64_t rows) {
#if defined(CPU_CAPABILITY_AVX512)
  (void)format;
  (void)rows;
  return false;
#else
  return format != QuantFormat::q8_0 || rows <= 128;
#endif
}

bool quant_gemm_maddubs(const QuantGemmArgs& a) {
  if (!a.int8 || a.K % kBlock != 0) return false;
  TORCH_CHECK(a.out_dtype == Dtype::f32 || a.out_dtype == Dtype::bf16,
              "quant_gemm: float32 or bfloat16 output only");
  PackedX x;
  const int64_t G = group_of(a.format);
  if (a.x_dtype == Dtype::f32) {
    pack_x<float>(a, G, x);
  } else {
    TORCH_CHECK(a.x_dtype == Dtype::bf16, "quant_gemm: float32 or bfloat16 x only");
    pack_x<vec::BF16>(a, G, x);
  }
  quant::with_format(a.format, [&](auto fmt) {
    constexpr QuantFormat Fmt = decltype(fmt)::value;
    if (a.out_dtype == Dtype::f32) {
      run<Fmt, float>(a, x);
    } else {
      run<Fmt, vec::BF16>(a, x);
    }
  });
  return true;
}

#else  // no AVX2 in this copy

bool maddubs_usable() { return false; }
bool maddubs_auto(QuantFormat, int64_t) { return false; }
bool quant_gemm_maddubs(const QuantGemmArgs&) { return false; }

#endif

PLUGSERVE_ISA_END
