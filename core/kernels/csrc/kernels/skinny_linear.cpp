// y = x @ w.T (+ bias) for a few rows of x: the decode step's linears, on the CPU.
//
// With one to a few dozen rows a linear layer is a stream over its weight: every weight
// element is used once per row. GEMM libraries tile for large products and, for 2..16 rows,
// reach a fraction of the memory bandwidth. Here each thread streams its share of the weight
// rows exactly once, in long contiguous runs (work_share.h), four rows at a time (prefetching
// 8 KiB ahead, pvec.h's prefetch_stream), and multiplies every block of them by all rows of x
// while it sits in registers and L1 (x itself is small and stays in cache).
//
// float32: products and sums are float32 FMAs. bfloat16 weights are read as bf16, half the
// bytes of float32, and widened in registers (a 16-bit shift); x is widened once per call, and
// the float32 sum plus the bias is rounded to bf16 once, at the end. In the avx512_bf16 copy
// vdpbf16ps multiplies pairs of bf16 values exactly and sums them in float32 instead (as
// oneDNN's bf16 matmul does), with x as bf16 too.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "../vec/pvec.h"
#include "work_share.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;

constexpr int64_t kRowsPerBlock = 4;  // weight rows streamed together
// Rows of x per register tile: MR x 4 accumulators + 4 weight vectors + 1 of x must fit.
constexpr int kXRows = kRegisters >= 32 ? 4 : 2;
// How far ahead of its loads each weight row is fetched. The hardware prefetchers alone leave
// a single-row stream at ~70% of a plain read's bandwidth (bf16: ~23 of ~30 GB/s on two Zen 4
// cores); 8 KiB ahead covers the DRAM latency at this loop's speed and brings it level. Into
// L1 there was slower than not prefetching (the lines evicted ones in use), into L1 on Intel
// Xeons faster than into L2: pvec.h's prefetch_stream picks by vendor.
constexpr int64_t kPrefetchBytes = 8192;

// A block's sums (its n_valid rows) plus bias, rounded to TO, into one row of the output.
template <typename TO>
inline void write_sums(const float* sums, const float* bias, int64_t n0, int64_t n_valid,
                       TO* out) {
  for (int j = 0; j < n_valid; ++j)
    out[n0 + j] = from_float<TO>(sums[j] + (bias != nullptr ? bias[n0 + j] : 0.0f));
}

// The line of row `r` kPrefetchBytes past its value k asked for, once per cache line of the
// row in a walk of kStep values a step (every step when a step covers a line or more), none
// at or past `stop` (none at all without one), as in `tile`.
template <int64_t kStep, typename TW>
inline void ask_line_ahead(const TW* r, int64_t k, const char* stop) {
  constexpr int64_t kLineValues = 64 / static_cast<int64_t>(sizeof(TW));
  constexpr int64_t kLineMask = kStep >= kLineValues ? 0 : kLineValues - 1;
  if (stop == nullptr || (k & kLineMask) != 0) return;
  const char* ahead = reinterpret_cast<const char*>(r + k) + kPrefetchBytes;
  if (ahead < stop) prefetch_stream(ahead);
}

// One row of x (batch-1 decode) times the block's weight rows one row after another: the
// block is contiguous, so this reads it as one stream, where the tile below walks its four
// rows side by side (four streams a row apart, which the hardware prefetchers follow worse;
// with more rows of x the tile's reuse of each weight vector is worth it). Each row's sum is
// added in exactly the tile's order (one accumulator, k ascending, the same tail and
// horizontal sum), so a row's float32 result does not depend on how many rows of x (up to
// the few this kernel takes) came with it. One FMA chain per row
// still outruns the memory: 32 bytes per FMA latency on AVX2. Measured on two Zen 3 cores
// (avx2 copy), float32, the tile before against this walk, alternated processes: the LM
// head's GEMV (49,152 x 576) 22.4 / 22.8 / 18.1 -> 30.9 / 27.4 / 24.8 GB/s (a walk with four
// accumulators a row read 25.8 / 30.6 / 21.2 beside them), the batch-1 decode step of
// SmolLM2-135M 22.27 / 25.23 / 22.56 -> 20.95 / 21.48 / 21.10 ms (best of four 64-token runs).
template <typename TW>
inline void rows_one_x(const float* __restrict x, const TW* const* w_rows, int64_t K,
                       float* sums, const char* prefetch_stop) {
  const int64_t full = K - K % kWidth;
  for (int j = 0; j < kRowsPerBlock; ++j) {
    const TW* r = w_rows[j];
    Reg acc = F(0.0f);
    for (int64_t k = 0; k < full; k += kWidth) {
      ask_line_ahead<kWidth>(r, k, prefetch_stop);
      acc = fmadd(F::loadu(x + k), load(r + k), acc);
    }
    if (full < K) acc = fmadd(F::loadu(x + full, K - full), load_n(r + full, K - full), acc);
    sums[j] = hsum(F(acc));
  }
}

// One tile: MR rows of x (float32) times kRowsPerBlock rows of w over all of K, plus bias,
// rounded to TO into out. Accumulators are an array indexed by constants in fully unrolled
// loops, which GCC keeps in registers.
template <typename TW, typename TO, int MR>
inline void tile(const float* __restrict x, int64_t x_stride, const TW* const* w_rows,
                 int64_t K, const float* bias, int64_t n0, int64_t n_valid, TO* __restrict out,
                 int64_t out_stride, const char* prefetch_stop) {
  if constexpr (MR == 1) {
    float sums[kRowsPerBlock];
    rows_one_x(x, w_rows, K, sums, prefetch_stop);
    write_sums(sums, bias, n0, n_valid, out);
    return;
  }
  Reg acc[MR][kRowsPerBlock];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = F(0.0f);
  const TW* r0 = w_rows[0];
  const TW* r1 = w_rows[1];
  const TW* r2 = w_rows[2];
  const TW* r3 = w_rows[3];
  const int64_t full = K - K % kWidth;
  // One prefetch per cache line of each row: a step of kWidth values covers a whole line
  // only with 512-bit float32 vectors (a bf16 step on AVX2 is a quarter line; asking for
  // the same line four times cost the AVX2 bf16 loop about a third of its instructions).
  constexpr int64_t kLineValues = 64 / static_cast<int64_t>(sizeof(TW));
  constexpr int64_t kLineMask = kWidth >= kLineValues ? 0 : kLineValues - 1;
  for (int64_t k = 0; k < full; k += kWidth) {
    if (prefetch_stop != nullptr && (k & kLineMask) == 0) {  // kPrefetchBytes on, in the share
      for (const TW* r : {r0, r1, r2, r3}) {
        const char* ahead = reinterpret_cast<const char*>(r + k) + kPrefetchBytes;
        if (ahead < prefetch_stop) prefetch_stream(ahead);
      }
    }
    const Reg w[kRowsPerBlock] = {load(r0 + k), load(r1 + k), load(r2 + k), load(r3 + k)};
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const F xv = F::loadu(x + i * x_stride + k);
#pragma GCC unroll 4
      for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = fmadd(xv, w[j], acc[i][j]);
    }
  }
  if (full < K) {
    const int64_t n = K - full;
    const Reg w[kRowsPerBlock] = {load_n(r0 + full, n), load_n(r1 + full, n),
                                  load_n(r2 + full, n), load_n(r3 + full, n)};
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const F xv = F::loadu(x + i * x_stride + full, n);
#pragma GCC unroll 4
      for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = fmadd(xv, w[j], acc[i][j]);
    }
  }
  // Every accumulator is read at a constant index (the sums first, in unrolled loops): an
  // array of vectors indexed at run time is kept in memory, and GCC then stores every
  // accumulator on every iteration, which halves the FMA rate.
  float sums[MR][kRowsPerBlock];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) sums[i][j] = hsum(F(acc[i][j]));
  for (int i = 0; i < MR; ++i) write_sums(sums[i], bias, n0, n_valid, out + i * out_stride);
}

#if defined(__AVX512BF16__)
// The avx512_bf16 tile: x and w as bf16, 32 values (16 pairs) per vdpbf16ps.
template <int MR>
inline void tile_bf16_dot(const BF16* __restrict x, int64_t x_stride, const BF16* const* w_rows,
                          int64_t K, const float* bias, int64_t n0, int64_t n_valid,
                          BF16* __restrict out, int64_t out_stride, const char* prefetch_stop) {
  __m512 acc[MR][kRowsPerBlock];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* rows[kRowsPerBlock];
  for (int j = 0; j < kRowsPerBlock; ++j) rows[j] = reinterpret_cast<const uint16_t*>(w_rows[j]);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? __mmask32(0xFFFFFFFFu)
                                       : __mmask32((uint32_t{1} << (K - k)) - 1);
    if (prefetch_stop != nullptr) {
      for (int j = 0; j < kRowsPerBlock; ++j) {
        const char* ahead = reinterpret_cast<const char*>(rows[j] + k) + kPrefetchBytes;
        if (ahead < prefetch_stop) prefetch_stream(ahead);
      }
    }
    __m512bh w[kRowsPerBlock];
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j)
      w[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + k);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + i * x_stride + k);
#pragma GCC unroll 4
      for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  float sums[MR][kRowsPerBlock];  // constant indices only (see `tile`)
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  for (int i = 0; i < MR; ++i) write_sums(sums[i], bias, n0, n_valid, out + i * out_stride);
}
#endif

#if !defined(__AVX512BF16__) && (defined(CPU_CAPABILITY_AVX512) || defined(__AVX2__))
#define PLUGSERVE_BF16_PAIRS 1
// bf16 weights on copies without bf16 dot products: a vector's 32-bit lanes each hold a pair
// of bf16 values, and the even one widened is the lane shifted left by 16, the odd one the
// lane with its low half masked off. So one load and two integer operations widen a whole
// vector of pairs, where widening half a vector at a time (vpmovzxwd and a shift per 8
// values) took twice the instructions (on the AVX2 copy, two Xeon cores: the LM head's GEMV
// 19.3 -> 21.0 GB/s, the bf16 batch-1 decode step 12.5-13.2 -> 11.6-11.9 ms). x is permuted
// once per call to match: in each chunk of kPairStep values, its even-indexed values first,
// then its odd-indexed ones.
#if defined(CPU_CAPABILITY_AVX512)
using PairVec = __m512;
using PairBits = __m512i;
inline PairBits load_pairs(const BF16* p) { return _mm512_loadu_si512(p); }
inline PairVec even_values(PairBits v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline PairVec odd_values(PairBits v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline PairVec pair_load_x(const float* p) { return _mm512_loadu_ps(p); }
inline PairVec pair_fma(PairVec a, PairVec b, PairVec c) { return _mm512_fmadd_ps(a, b, c); }
inline PairVec pair_zero() { return _mm512_setzero_ps(); }
inline float pair_sum(PairVec v) { return _mm512_reduce_add_ps(v); }
#else
using PairVec = __m256;
using PairBits = __m256i;
inline PairBits load_pairs(const BF16* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline PairVec even_values(PairBits v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline PairVec odd_values(PairBits v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline PairVec pair_load_x(const float* p) { return _mm256_loadu_ps(p); }
inline PairVec pair_fma(PairVec a, PairVec b, PairVec c) { return _mm256_fmadd_ps(a, b, c); }
inline PairVec pair_zero() { return _mm256_setzero_ps(); }
inline float pair_sum(PairVec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif
constexpr int64_t kPairLanes = static_cast<int64_t>(sizeof(PairVec) / 4);
constexpr int64_t kPairStep = 2 * kPairLanes;  // bf16 values per vector of pairs

// x [M, K] float32 with every whole chunk of kPairStep values permuted (evens, then odds);
// the tail past the last whole chunk as it is.
std::vector<float> pair_permuted(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  const int64_t full = K - K % kPairStep;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float* dst = out.data() + m * K;
    for (int64_t c = 0; c < full; c += kPairStep) {
      for (int64_t i = 0; i < kPairLanes; ++i) {
        dst[c + i] = row[c + 2 * i];
        dst[c + kPairLanes + i] = row[c + 2 * i + 1];
      }
    }
    for (int64_t k = full; k < K; ++k) dst[k] = row[k];
  }
  return out;
}

// One row of x (batch-1 decode) times the block's bf16 weight rows one row after another:
// the block is contiguous, so this reads it as one stream, where the MR > 1 tile walks its
// rows side by side (four streams a row apart, which the hardware prefetchers follow worse).
// Two lines per step, four accumulators (two dependent FMAs a line otherwise bound the loop
// by their latency). Measured on two Cascade Lake cores, batch-1 bf16 decode of
// SmolLM2-135M, best of three 128-token runs, alternated: 15.5-16.3 -> 15.2-15.6 ms per step
// (both prefetching into L1); the avx2 copy there, prefetching into L2: 16.3-17.3 -> 16.0-16.7.
inline void rows_bf16_pairs_one_x(const float* __restrict x, const BF16* const* w_rows,
                                  int64_t K, float* sums, const char* prefetch_stop) {
  const int64_t full = K - K % kPairStep;
  for (int j = 0; j < kRowsPerBlock; ++j) {
    const BF16* r = w_rows[j];
    PairVec a0 = pair_zero(), a1 = pair_zero(), a2 = pair_zero(), a3 = pair_zero();
    int64_t k = 0;
    for (; k + 2 * kPairStep <= full; k += 2 * kPairStep) {
      ask_line_ahead<kPairStep>(r, k, prefetch_stop);
      ask_line_ahead<kPairStep>(r, k + kPairStep, prefetch_stop);
      const PairBits w0 = load_pairs(r + k), w1 = load_pairs(r + k + kPairStep);
      a0 = pair_fma(pair_load_x(x + k), even_values(w0), a0);
      a1 = pair_fma(pair_load_x(x + k + kPairLanes), odd_values(w0), a1);
      a2 = pair_fma(pair_load_x(x + k + kPairStep), even_values(w1), a2);
      a3 = pair_fma(pair_load_x(x + k + kPairStep + kPairLanes), odd_values(w1), a3);
    }
    if (k < full) {  // one vector of pairs left
      ask_line_ahead<kPairStep>(r, k, prefetch_stop);
      const PairBits w0 = load_pairs(r + k);
      a0 = pair_fma(pair_load_x(x + k), even_values(w0), a0);
      a1 = pair_fma(pair_load_x(x + k + kPairLanes), odd_values(w0), a1);
    }
    float sum = pair_sum(a0) + pair_sum(a1) + pair_sum(a2) + pair_sum(a3);
    for (k = full; k < K; ++k) sum += x[k] * to_float(r[k]);  // the tail, in x's own order
    sums[j] = sum;
  }
}

// The bf16 tile: MR rows of the permuted x times kRowsPerBlock bf16 weight rows.
template <int MR>
inline void tile_bf16_pairs(const float* __restrict x, int64_t x_stride,
                            const BF16* const* w_rows, int64_t K, const float* bias, int64_t n0,
                            int64_t n_valid, BF16* __restrict out, int64_t out_stride,
                            const char* prefetch_stop) {
  if constexpr (MR == 1) {
    float sums[kRowsPerBlock];
    rows_bf16_pairs_one_x(x, w_rows, K, sums, prefetch_stop);
    write_sums(sums, bias, n0, n_valid, out);
    return;
  }
  PairVec acc[MR][kRowsPerBlock];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) acc[i][j] = pair_zero();
  const int64_t full = K - K % kPairStep;
  for (int64_t k = 0; k < full; k += kPairStep) {
    for (int j = 0; j < kRowsPerBlock; ++j)
      ask_line_ahead<kPairStep>(w_rows[j], k, prefetch_stop);
    PairBits w[kRowsPerBlock];
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) w[j] = load_pairs(w_rows[j] + k);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const PairVec xe = pair_load_x(x + i * x_stride + k);
      const PairVec xo = pair_load_x(x + i * x_stride + k + kPairLanes);
#pragma GCC unroll 4
      for (int j = 0; j < kRowsPerBlock; ++j) {
        acc[i][j] = pair_fma(xe, even_values(w[j]), acc[i][j]);
        acc[i][j] = pair_fma(xo, odd_values(w[j]), acc[i][j]);
      }
    }
  }
  float sums[MR][kRowsPerBlock];  // constant indices only (see `tile`)
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowsPerBlock; ++j) sums[i][j] = pair_sum(acc[i][j]);
  for (int64_t k = full; k < K; ++k) {  // the tail, in x's own order
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kRowsPerBlock; ++j)
        sums[i][j] += x[i * x_stride + k] * to_float(w_rows[j][k]);
  }
  for (int i = 0; i < MR; ++i) write_sums(sums[i], bias, n0, n_valid, out + i * out_stride);
}
#endif

// Every block of 4 weight rows times all rows of x (tiles of kXRows), over the contiguous
// run of blocks [begin, end), prefetching ahead up to block `stop` (the end of the run this
// thread walks). TX is float (the widened x) or, for the bf16-dot tile, BF16.
template <typename TX, typename TW, typename TO, typename Tile>
void run_share(const TX* x, int64_t x_stride, const TW* w, const float* bias, TO* out,
               int64_t M, int64_t K, int64_t N, int64_t begin, int64_t end, int64_t stop,
               Tile&& tile_fn) {
  const char* share_end =
      reinterpret_cast<const char*>(w + std::min(stop * kRowsPerBlock, N) * K);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n0 = b * kRowsPerBlock;
    const int64_t n_valid = std::min(kRowsPerBlock, N - n0);
    const TW* w_rows[kRowsPerBlock];
    for (int64_t j = 0; j < kRowsPerBlock; ++j)
      w_rows[j] = w + std::min(n0 + j, N - 1) * K;  // past N: re-read the last row
    // The stream ahead is fetched on the block's first tile of x rows only (the later ones
    // find the block in cache), and not past this thread's run.
    const char* prefetch = share_end;
    int64_t m0 = 0;
    for (; m0 + kXRows <= M; m0 += kXRows, prefetch = nullptr) {
      tile_fn(std::integral_constant<int, kXRows>{}, x + m0 * x_stride, w_rows, n0, n_valid,
              out + m0 * N, prefetch);
    }
    const TX* xr = x + m0 * x_stride;
    TO* o = out + m0 * N;
    switch (M - m0) {
      case 3:
        if constexpr (kXRows > 3)
          tile_fn(std::integral_constant<int, 3>{}, xr, w_rows, n0, n_valid, o, prefetch);
        break;
      case 2:
        if constexpr (kXRows > 2)
          tile_fn(std::integral_constant<int, 2>{}, xr, w_rows, n0, n_valid, o, prefetch);
        break;
      case 1: tile_fn(std::integral_constant<int, 1>{}, xr, w_rows, n0, n_valid, o, prefetch); break;
      default: break;
    }
  }
}

// Rows of x per pass over the weight: their float32 copy (at most 128 x K) stays in L2
// while every weight block of the thread's share meets it.
constexpr int64_t kMBlock = 128;

// The blocks of 4 weight rows split between the threads in contiguous runs (work_share.h),
// a few KiB of weight per claim: fn(begin, end, stop) as run_share takes them.
template <typename TW, typename Fn>
void share_blocks(int64_t N, int64_t K, const Fn& fn) {
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  work_share::for_each_chunk(
      blocks, work_share::chunk_units(kRowsPerBlock * K * static_cast<int64_t>(sizeof(TW))),
      [&](const work_share::Run& r) { fn(r.begin, r.end, r.stop); });
}

template <typename TW, typename TO>
void run_widened(const float* x, int64_t x_stride, const TW* w, const float* bias, TO* out,
                 int64_t M, int64_t K, int64_t N) {
  auto run = [&](int64_t begin, int64_t end, int64_t stop) {
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
      run_share(x + m0 * x_stride, x_stride, w, bias, out + m0 * N, std::min(kMBlock, M - m0),
                K, N, begin, end, stop,
                [&](auto mr, const float* xr, const TW* const* rows, int64_t n0,
                    int64_t n_valid, TO* o, const char* prefetch) {
                  tile<TW, TO, decltype(mr)::value>(xr, x_stride, rows, K, bias, n0, n_valid,
                                                    o, N, prefetch);
                });
    }
  };
  if (M <= kMBlock) {
    share_blocks<TW>(N, K, run);
    return;
  }
  // Many rows (the widening GEMM): every block meets each 128 rows of x in turn, so a
  // thread keeps one static share, each pass over it with one x block in L2 (runs of a few
  // blocks would stream all of x once per run).
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) { run(begin, end, end); });
}

// x [M, K] of T as contiguous float32 (the few-row and widening paths multiply in float32).
template <typename T>
std::vector<float> widen_rows(const T* x, int64_t x_stride, int64_t M, int64_t K) {
  std::vector<float> x32(M * K);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * x_stride;
      float* dst = x32.data() + m * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) dst[k] = to_float(row[k]);
    }
  });
  return x32;
}

template <typename TX, typename TW>
void widening_gemm_typed(const WideningGemmArgs& a) {
  const TX* x = static_cast<const TX*>(a.x);
  const TW* w = static_cast<const TW*>(a.w);
  TX* out = static_cast<TX*>(a.out);
  if constexpr (std::is_same_v<TX, float>) {
    run_widened(x, a.x_stride, w, a.bias, out, a.M, a.K, a.N);
  } else {
    const std::vector<float> x32 = widen_rows(x, a.x_stride, a.M, a.K);
    run_widened(x32.data(), a.K, w, a.bias, out, a.M, a.K, a.N);
  }
}

}  // namespace

void skinny_linear(const SkinnyLinearArgs& a) {
  if (a.dtype == Dtype::f32) {
    run_widened(static_cast<const float*>(a.x), a.x_stride, static_cast<const float*>(a.w),
                a.bias, static_cast<float*>(a.out), a.M, a.K, a.N);
    return;
  }
  TORCH_CHECK(a.dtype == Dtype::bf16, "skinny_linear: float32 or bfloat16 operands only");
  const BF16* x = static_cast<const BF16*>(a.x);
  const BF16* w = static_cast<const BF16*>(a.w);
  BF16* out = static_cast<BF16*>(a.out);
#if defined(__AVX512BF16__)
  share_blocks<BF16>(a.N, a.K, [&](int64_t begin, int64_t end, int64_t stop) {
    run_share(x, a.x_stride, w, a.bias, out, a.M, a.K, a.N, begin, end, stop,
              [&](auto mr, const BF16* xr, const BF16* const* rows, int64_t n0,
                  int64_t n_valid, BF16* o, const char* prefetch) {
                tile_bf16_dot<decltype(mr)::value>(xr, a.x_stride, rows, a.K, a.bias, n0,
                                                   n_valid, o, a.N, prefetch);
              });
  });
#else
  // x widened once (a few rows: it stays in cache), the weight as it streams.
  const std::vector<float> x32 = widen_rows(x, a.x_stride, a.M, a.K);
#if defined(PLUGSERVE_BF16_PAIRS)
  {
    const std::vector<float> xp = pair_permuted(x32.data(), a.M, a.K);
    share_blocks<BF16>(a.N, a.K, [&](int64_t begin, int64_t end, int64_t stop) {
      run_share(xp.data(), a.K, w, a.bias, out, a.M, a.K, a.N, begin, end, stop,
                [&](auto mr, const float* xr, const BF16* const* rows, int64_t n0,
                    int64_t n_valid, BF16* o, const char* prefetch) {
                  tile_bf16_pairs<decltype(mr)::value>(xr, a.K, rows, a.K, a.bias, n0,
                                                       n_valid, o, a.N, prefetch);
                });
    });
    return;
  }
#endif
  run_widened(x32.data(), a.K, w, a.bias, out, a.M, a.K, a.N);
#endif
}

// The same register tiles for any number of rows, the weight read in its own half-precision
// dtype and widened in registers: the GEMM for bf16 / fp16 weights where the CPU has no
// native half dot products (no float32 copy of the weights is kept anywhere).
void widening_gemm(const WideningGemmArgs& a) {
  switch (a.w_dtype) {
    case Dtype::bf16:
      PLUGSERVE_FLOAT_TYPES(a.act_dtype, "widening_gemm", widening_gemm_typed<T, BF16>(a));
      break;
    case Dtype::f16:
      PLUGSERVE_FLOAT_TYPES(a.act_dtype, "widening_gemm", widening_gemm_typed<T, Half>(a));
      break;
    default: TORCH_CHECK(false, "widening_gemm: bf16 or fp16 weights only");
  }
}

PLUGSERVE_ISA_END
