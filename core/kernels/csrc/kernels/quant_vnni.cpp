// The many-row quantized linear with int8 activations on AVX512-VNNI, for CPUs without AMX:
// out = x_int8 @ dequantize(w).T with integer dot products (vpdpbusd: 64 byte products an
// instruction, where a float32 FMA does 16), for a decode batch's rows and a prefill's.
//
// Compiled into the AVX-512 copies; the `avx512` copy is built without VNNI (Skylake-X has
// none), so the functions that use it carry the target attribute themselves and the kernel
// asks the CPU once (`__builtin_cpu_supports`); without VNNI it returns false and the op runs
// the dequantize-and-GEMM path.
//
// x [M, K] is rounded through int8 per 32-block as the other kernels round it
// (quant_row_bf16.h) and packed once per call, 16 rows a vector: [M / 16][K / 4][16 rows][4]
// signed bytes (16 x 16 transposes of 4-byte groups), with each 32-block's scale dx,
// dx * sum(q) and each group's -sum(q) as vectors over the 16 rows. Each task takes panels of
// kPanelRows weight rows and decodes them (quant_panel.h) into unsigned bytes (vpdpbusd
// multiplies unsigned by signed bytes: the formats without a constant are shifted by 8, 16,
// 32 or 128), a scale per group of G weights (16 for Q6_K, whose scales are per 16, else 32)
// and each 32-block's constant, all kept in L1 / L2; then every tile of 2 x-vectors (32 rows)
// x kTileRows weight rows runs over K: per group, the int32 sums of G / 4 vpdpbusd steps
// (x's packed bytes against a weight row's 4 bytes broadcast), started at -shift * sum(xq) so
// that they are sum(q * xq) exactly, are scaled into float32 sums: sum += float(int) *
// (g * dx) (+ c * dx * sum(xq) for the formats with a constant). A tile's sums are vectors
// over x's rows, so each panel's results are transposed 16 x 16 into out (rows of N), with
// the bias.
//
// Measured on a 2-core Xeon (AVX-512 + VNNI, no AMX), Q8_0, ms per call (weights in cache;
// benchmarks/quant_linear_speed.py --many ... --kernels vnni / strips): 1536 x 576 at 16 /
// 64 / 128 / 1024 rows 0.14 / 0.30 / 0.55 / 4.9 against 1.0 / 0.87 / 1.6 / 7.9 for the
// dequantize-and-GEMM path (float32 oneDNN).
//
// Sums: exact integer products per group, then float32: the few-row kernel's arithmetic, not
// the bits of the dequantize-and-GEMM path (float32 products of dequantized weights).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "../vec/pvec.h"
#include "quant_blocks.h"
#include "quant_panel.h"
#include "quant_row_bf16.h"
#include "transpose16.h"

PLUGSERVE_ISA_BEGIN

#if defined(CPU_CAPABILITY_AVX512)
namespace {

using namespace vec;
using quant::dword_at;
using quant::group_of;
using quant::kBlock;
using quant::kPanelRows;
using quant::Panel;

#define PLUGSERVE_VNNI __attribute__((target("avx512vnni")))

constexpr int64_t kLanes = 16;      // rows of x per vector of int32 sums
constexpr int kTileVectors = 2;     // x-vectors per tile (32 rows)
constexpr int kTileRows = 6;        // weight rows per tile (a divisor of kPanelRows)

bool cpu_has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
}

// What a format's decoded quants (quant_blocks.h: signed) are shifted by to be unsigned bytes,
// vpdpbusd's unsigned operand: the formats with a constant have unsigned quants already.
constexpr int unsigned_offset(QuantFormat f) {
  return f == QuantFormat::q8_0 ? 128 : f == QuantFormat::q4_0 ? 8
       : f == QuantFormat::q5_0 ? 16 : f == QuantFormat::q6_k ? 32 : 0;
}

using PackedX = quant::PackedX<kLanes>;

template <typename T>
void pack_x(const QuantGemmArgs& a, int64_t G, PackedX& p) {
  p.init(a.M, a.K, G);
  const T* x = static_cast<const T*>(a.x);
  at::parallel_for(0, p.vectors, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> rows_q(kLanes * a.K);  // the vector's rows of quants, [16][K]
    for (int64_t v = begin; v < end; ++v) {
      const int64_t m0 = v * kLanes, rows = std::min(kLanes, a.M - m0);
      float* scale = p.scale.data() + v * p.blocks * kLanes;
      float* sum = p.sum.data() + v * p.blocks * kLanes;
      int32_t* neg = p.neg.data() + v * p.groups * kLanes;
      for (int64_t i = 0; i < rows; ++i) {
        int8_t* q = rows_q.data() + i * a.K;
        quant::for_each_int8_block(
            x + (m0 + i) * a.x_stride, a.K, [&](int64_t k0, __m512 qlo, __m512 qhi, float d) {
              _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0),
                               _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(qlo)));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16),
                               _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(qhi)));
              // whole numbers of at most 16 * 127: exact in float
              const float lo = _mm512_reduce_add_ps(qlo), hi = _mm512_reduce_add_ps(qhi);
              const int64_t b = k0 / kBlock;
              scale[b * kLanes + i] = d;
              sum[b * kLanes + i] = d * (lo + hi);
              if (G == kBlock) {
                neg[b * kLanes + i] = -static_cast<int32_t>(lo + hi);
              } else {
                neg[2 * b * kLanes + i] = -static_cast<int32_t>(lo);
                neg[(2 * b + 1) * kLanes + i] = -static_cast<int32_t>(hi);
              }
            });
      }
      std::fill(rows_q.begin() + rows * a.K, rows_q.end(), 0);  // rows past M: zero quants
      // [16 rows][K] -> [K / 4][16 rows][4]: 16 x 16 transposes of 4-byte groups.
      int8_t* packed = p.q.data() + v * a.K * kLanes;
      for (int64_t k = 0; k < a.K; k += 64) {
        const int64_t groups4 = std::min<int64_t>(kLanes, (a.K - k) / 4);
        const __mmask16 lanes = static_cast<__mmask16>((1u << groups4) - 1);
        __m512i t[kLanes];
        for (int64_t i = 0; i < kLanes; ++i)
          t[i] = _mm512_maskz_loadu_epi32(lanes, rows_q.data() + i * a.K + k);
        tr::transpose16(t);
        for (int64_t j = 0; j < groups4; ++j) _mm512_storeu_si512(packed + (k / 4 + j) * 64, t[j]);
      }
    }
  });
}

// The float32 sums of R x-vectors (from v0) times kTileRows panel rows (from n), over all K,
// into t[row][R * 16] (row-major over the panel's rows, lanes over x's rows). Per group:
// sum (q + offset) * xq over the group, started at -offset * sum(xq), is sum q * xq exactly.
template <int G, int Offset, bool Min, int R>
PLUGSERVE_VNNI void tile(const PackedX& x, int64_t v0, const Panel& p, int64_t n,
                         float* __restrict t) {
  static_assert(Offset == 0 || (Offset & (Offset - 1)) == 0, "a power of two");
  constexpr int kShift = Offset == 0 ? 0 : __builtin_ctz(Offset);
  const int64_t K = x.K, groups = K / G, blocks = x.blocks;
  const quant::XVectors<kLanes, R> xv_at(x, v0);
  const auto& xq = xv_at.q;
  const auto& xs = xv_at.scale;
  const auto& xsum = xv_at.sum;
  const auto& xneg = xv_at.neg;
  const uint8_t* wq = p.q.data() + n * K;
  const float* wg = p.g.data() + n * groups;
  const float* wc = p.c.data() + n * blocks;
  __m512 acc[kTileRows][R];
#pragma GCC unroll 8
  for (int j = 0; j < kTileRows; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    __m512i start[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      start[r] = Offset == 0 ? _mm512_setzero_si512()
                             : _mm512_slli_epi32(_mm512_loadu_si512(xneg[r] + b * kLanes),
                                                 kShift);
    }
    __m512i sums[kTileRows][R];
#pragma GCC unroll 8
    for (int j = 0; j < kTileRows; ++j)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sums[j][r] = start[r];
#pragma GCC unroll 8
    for (int s = 0; s < G / 4; ++s) {
      const int64_t k4 = b * (G / 4) + s;
      __m512i xv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(xq[r] + k4 * 64);
#pragma GCC unroll 8
      for (int j = 0; j < kTileRows; ++j) {
        const __m512i wv = _mm512_set1_epi32(dword_at(wq + j * K + 4 * k4));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) sums[j][r] = _mm512_dpbusd_epi32(sums[j][r], wv, xv[r]);
      }
    }
    // acc += float(sum) * (g * dx), then + c * dx * sum(xq) for the formats with a constant
    // (G == 32 for them: one constant per group).
    const int64_t blk = b * G / kBlock;
    __m512 dx[R], sx[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      dx[r] = _mm512_loadu_ps(xs[r] + blk * kLanes);
      if constexpr (Min) sx[r] = _mm512_loadu_ps(xsum[r] + blk * kLanes);
    }
#pragma GCC unroll 8
    for (int j = 0; j < kTileRows; ++j) {
      const __m512 g = _mm512_set1_ps(wg[j * groups + b]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[j][r]), _mm512_mul_ps(g, dx[r]),
                                    acc[j][r]);
        if constexpr (Min)
          acc[j][r] = _mm512_fmadd_ps(_mm512_set1_ps(wc[j * blocks + blk]), sx[r], acc[j][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kTileRows; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(t + j * R * kLanes + r * kLanes, acc[j][r]);
}

// The panel's sums t [kPanelRows][lanes] (lanes: 16 or 32) for x's rows m0 .. m0 + rows,
// into out with the bias, transposed 16 x 16 at a time.
template <typename TO>
void store_panel(const QuantGemmArgs& a, const float* t, int64_t lanes, int64_t m0,
                 int64_t rows, int64_t n0) {
  const int64_t cols = std::min(kPanelRows, a.N - n0);
  TO* out = static_cast<TO*>(a.out);
  for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
    const int64_t n = std::min(kLanes, cols - c0);
    const F bias = a.bias == nullptr ? F(0.0f) : load_n(a.bias + n0 + c0, n);
    for (int64_t l0 = 0; l0 < rows; l0 += kLanes) {
      __m512i r[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        r[i] = _mm512_loadu_si512(t + (c0 + i) * lanes + l0);
      tr::transpose16(r);
      for (int64_t i = 0; i < std::min(kLanes, rows - l0); ++i) {
        const F y = F(_mm512_castsi512_ps(r[i])) + bias;
        TO* dst = out + (m0 + l0 + i) * a.N + n0 + c0;
        if (n == kLanes) {
          store(dst, y);
        } else {
          store_n(dst, y, n);
        }
      }
    }
  }
}

template <QuantFormat Fmt, int G, typename TO>
PLUGSERVE_VNNI void panels(const QuantGemmArgs& a, const PackedX& x, int64_t begin,
                           int64_t end) {
  constexpr bool kMin = quant::has_min(Fmt);
  constexpr int kOffset = unsigned_offset(Fmt);
  Panel p;
  std::vector<float> t(kPanelRows * kTileVectors * kLanes);
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n0 = pi * kPanelRows;
    quant::decode_panel<Fmt, G, kOffset>(a.w, a.w_row_bytes, a.K, a.N, n0, p);
    for (int64_t v = 0; v < x.vectors; v += kTileVectors) {
      const int64_t vs = std::min<int64_t>(kTileVectors, x.vectors - v);
      for (int64_t n = 0; n < kPanelRows; n += kTileRows) {
        float* tn = t.data() + n * vs * kLanes;
        if (vs == 2) {
          tile<G, kOffset, kMin, 2>(x, v, p, n, tn);
        } else {
          tile<G, kOffset, kMin, 1>(x, v, p, n, tn);
        }
      }
      const int64_t m0 = v * kLanes;
      store_panel<TO>(a, t.data(), vs * kLanes, m0, std::min(vs * kLanes, a.M - m0), n0);
    }
  }
}

template <QuantFormat Fmt, typename TO>
void run(const QuantGemmArgs& a, const PackedX& x) {
  constexpr int G = group_of(Fmt);
  const int64_t count = (a.N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    panels<Fmt, G, TO>(a, x, begin, end);
  });
}

}  // namespace

bool vnni_usable() { return cpu_has_vnni(); }

bool quant_gemm_vnni(const QuantGemmArgs& a) {
  if (!cpu_has_vnni() || !a.int8 || a.K % kBlock != 0) return false;
  TORCH_CHECK(a.out_dtype == Dtype::f32 || a.out_dtype == Dtype::bf16,
              "quant_gemm: float32 or bfloat16 output only");
  PackedX x;
  const int64_t G = group_of(a.format);
  if (a.x_dtype == Dtype::f32) {
    pack_x<float>(a, G, x);
  } else {
    TORCH_CHECK(a.x_dtype == Dtype::bf16, "quant_gemm: float32 or bfloat16 x only");
    pack_x<BF16>(a, G, x);
  }
  quant::with_format(a.format, [&](auto fmt) {
    constexpr QuantFormat Fmt = decltype(fmt)::value;
    if (a.out_dtype == Dtype::f32) {
      run<Fmt, float>(a, x);
    } else {
      run<Fmt, BF16>(a, x);
    }
  });
  return true;
}

#else  // no AVX-512 in this copy

bool vnni_usable() { return false; }
bool quant_gemm_vnni(const QuantGemmArgs&) { return false; }

#endif

PLUGSERVE_ISA_END
