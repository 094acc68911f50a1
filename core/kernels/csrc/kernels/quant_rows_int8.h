// The few-row int8 path of the 4-, 5- and 6-bit GGML formats (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K) on the copies with AVX2 (included by quant_linear.cpp inside its ISA namespace,
// after quant_blocks.h and quant_x_int8.h). Each thread streams its share of weight rows once;
// with one row of x, four weight rows at a time (four independent accumulator chains, four
// streams of blocks in flight, x's loads shared). The dot products themselves:
// quant_dot_avx512.h (its comment has the method) and quant_dot_avx2.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

PLUGSERVE_ISA_BEGIN
namespace quant {

constexpr int64_t kMaxRows = 16;          // rows of x per pass over the weight

inline int64_t out_stride(const QuantLinearArgs& a) {
  return a.out_stride > 0 ? a.out_stride : a.N;
}
constexpr int64_t kPrefetchBytes = 8192;  // see skinny_linear.cpp

// The lines of the block at `b` (`bytes` long) kPrefetchBytes further on, into L2, none at or
// past `stop` (the end of this thread's share of the weight).
inline void prefetch_block_ahead(const uint8_t* b, int64_t bytes, const char* stop) {
  for (int64_t off = 0; off < bytes; off += 64) {
    const char* ahead = reinterpret_cast<const char*>(b) + off + kPrefetchBytes;
    if (ahead < stop) vec::prefetch_l2(ahead);
  }
}

// The lines of [from, from + bytes) into L2 at once, none at or past `stop`: the start of a
// run of blocks, which the loops' own prefetches (kPrefetchBytes ahead of what they read)
// never ask for.
inline void prefetch_lines(const uint8_t* from, int64_t bytes, const char* stop) {
  const char* p = reinterpret_cast<const char*>(from);
  const char* end = std::min(p + bytes, stop);
  for (; p < end; p += 64) vec::prefetch_l2(p);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Where a small format's quants start in its block (after d, m, qh).
constexpr int64_t small_qs_at(QuantFormat f) {
  const bool five = f == QuantFormat::q5_0 || f == QuantFormat::q5_1;
  return (has_min(f) ? 4 : 2) + (five ? 4 : 0);
}

// The formats this path takes. Q8_0 only with VNNI: its quants as unsigned bytes (q + 128)
// would overflow vpmaddubsw's int16 sums.
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// What the unsigned quants the kernels multiply exceed the format's signed ones by. Q8_0's
// only with VNNI (q + 128 would overflow vpmaddubsw's int16 sums): else its signed quants
// multiply with the sign trick.
constexpr int quant_offset(QuantFormat f) {
  return f == QuantFormat::q4_0   ? 8
         : f == QuantFormat::q5_0 ? 16
         : f == QuantFormat::q8_0 ? (kVnni ? 128 : 0)
                                  : 0;
}

#if defined(__AVX2__)
// The 6-bit scales and mins of a Q4_K / Q5_K superblock (12 packed bytes at s) as 16 bytes:
// the 8 scales, then the 8 mins (scale_min_k4 for all j at once, llama.cpp's kmask masks).
inline __m128i k4_scales_mins(const uint8_t* s) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_lo = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_lo;
  u[0] &= kmask1;
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
}
#endif

}  // namespace quant
PLUGSERVE_ISA_END

#include "quant_dot_avx2.h"
#include "quant_dot_avx512.h"

PLUGSERVE_ISA_BEGIN
namespace quant {
#if defined(__AVX2__)

// y[r * M + m] for R weight rows from `row` (row_bytes apart) and M rows of x.
// 64 weights per register on the AVX-512 copies, except Q8_0: its 256-bit code runs faster
// (measured: two 32-byte loads and an insert per 512-bit pair load port 5, which the scales'
// conversion and spreading already keep busy).
template <QuantFormat F>
constexpr bool uses_512() {
#if defined(CPU_CAPABILITY_AVX512)
  return F != QuantFormat::q8_0;
#else
  return false;
#endif
}

// y[r * M + m] for R weight rows from `row` (row_bytes apart) and M rows of x.
template <QuantFormat F, int R, int MR>
inline void dot_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M,
                     const char* stop, float* y) {
#if defined(CPU_CAPABILITY_AVX512)
  namespace wide = v512;
#else
  namespace wide = v256;
#endif
  if constexpr (F == QuantFormat::q6_k) {
    wide::q6k_rows<R, MR>(row, row_bytes, x, M, stop, y);
  } else if constexpr (block_elems(F) == 256) {
    wide::k4_rows<F, R, MR>(row, row_bytes, x, M, stop, y);
  } else if constexpr (uses_512<F>()) {
    wide::small_rows<F, R, MR>(row, row_bytes, x, M, stop, y);
  } else {
    v256::small_rows<F, R, MR>(row, row_bytes, x, M, stop, y);
  }
}

// Weight rows one pass over a single row of x takes at once: four (four accumulator chains,
// x's loads shared), except Q8_0 on the avx2 copy: one, each row's blocks read to its end
// before the next row's, one sequential stream (as the dense fp32 and bf16 walks in
// skinny_linear.cpp). Measured on two Zen 3 cores: a variant of the four-row pass that only
// loads (no arithmetic) streamed the LM head's Q8_0 weight no faster than the kernel (16.4
// against 16.5 GB/s), so the four interleaved streams, not the sign trick's arithmetic, held
// it; one row at a time read 17.7-19.3 GB/s where the four-row pass read 14.5-16.2. The
// 4-bit formats unpack more per byte and lost with one row (step medians: Q4_1 8.76 -> 9.63
// ms, Q4_K_M 9.05 -> 10.73).
// A row's sums are added in the same order either way: the same bits as with more rows.
template <QuantFormat F>
constexpr int rows_per_pass_one_x() {
#if defined(CPU_CAPABILITY_AVX512)
  return 4;
#else
  return F == QuantFormat::q8_0 ? 1 : 4;
#endif
}

// Rows [n_begin, n_end) of the output for rows [m0, m0 + M) of x (M <= kMaxRows), prefetching
// ahead up to row n_stop (the end of the run this thread walks). The run's first
// kPrefetchBytes are asked for at once unless `resumed` (the thread's previous rows ended at
// n_begin and their loop asked for them already: asking again would hold line-fill buffers
// on lines that are on their way).
template <QuantFormat F, typename TO>
void rows_int8_fast(const QuantLinearArgs& a, const Int8Rows& xr, int64_t m0, int64_t M,
                    int64_t n_begin, int64_t n_end, int64_t n_stop, bool resumed) {
  const XRows x(xr, m0);
  const char* stop = reinterpret_cast<const char*>(a.w + n_stop * a.w_row_bytes);
  if (!resumed) prefetch_lines(a.w + n_begin * a.w_row_bytes, kPrefetchBytes, stop);
  TO* out = static_cast<TO*>(a.out);
  auto store = [&](int64_t n, int64_t rows, const float* y) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t m = 0; m < M; ++m)
        out[(m0 + m) * out_stride(a) + n + r] =
            vec::from_float<TO>(y[r * M + m] + (a.bias != nullptr ? a.bias[n + r] : 0.0f));
  };
  float y[4 * kMaxRows];
  int64_t n = n_begin;
  if (M == 1) {
    constexpr int R = rows_per_pass_one_x<F>();
    for (; n + R <= n_end; n += R) {
      dot_rows<F, R, 1>(a.w + n * a.w_row_bytes, a.w_row_bytes, x, 1, stop, y);
      store(n, R, y);
    }
    for (; n < n_end; ++n) {
      dot_rows<F, 1, 1>(a.w + n * a.w_row_bytes, a.w_row_bytes, x, 1, stop, y);
      store(n, 1, y);
    }
    return;
  }
  for (; n < n_end; ++n) {
    dot_rows<F, 1, 0>(a.w + n * a.w_row_bytes, a.w_row_bytes, x, M, stop, y);
    store(n, 1, y);
  }
}

#endif
}  // namespace quant
PLUGSERVE_ISA_END
