// y = x @ dequantize(w).T (+ bias) for a few rows of x with w kept in its GGML blocks: the
// decode step's linears over a quantized model (the many-row path is quant_gemm.cpp).
//
// Each thread streams its share of weight rows once, in long contiguous runs (work_share.h;
// prefetching ahead into L2, as skinny_linear.cpp does) and multiplies it by every row of x:
// - int8 activations (llama.cpp's scheme): x is rounded per 32-block to int8 once per call
//   (scale max|x| / 127, kept as fp16; quant_x_int8.h); the products are integer dot
//   products, 4 weights per int32 lane. The copies with AVX2 take quant_rows_int8.h: blocks
//   unpacked in registers into unsigned quants multiplied by x's int8 quants directly,
//   offsets and mins from x's per-block sums, 64 weights per register on AVX-512 (its
//   header has the method; Q8_0 without VNNI: signed, the sign trick). Measured
//   on a 2-core Xeon (AVX-512 VNNI, the avx512_bf16 copy), batch 1, weights streamed from
//   memory, against the former decode-to-L1 / sign-trick code (x the dense fp32 kernel's
//   time, benchmarks/quant_linear_speed.py): Q4_1 1536x576 3.25 -> 3.88, Q4_K 576x1536
//   2.32 -> 4.02, Q6_K 2.07 -> 3.06. The scalar copy decodes each chunk of 256 weights into
//   int8 quants with per-16 scales and per-32 constants (quant_blocks.h) while it sits in
//   L1, scaled per lane in float32; the per-32 constants multiply the x block's sum.
// - float activations: the chunk is widened to float32 (q * scale + constant) and multiplied
//   in float32 FMAs.
// quant_linear_parts runs several weights sharing x (a projection's parts in different
// formats) in one pass: x rounded once, one split of all their rows between the threads.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "../vec/pvec.h"
#include "quant_blocks.h"
#include "quant_x_int8.h"
#include "quant_rows_int8.h"
#include "work_share.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using quant::Chunk;
using quant::kBlock;
using quant::kChunk;

using quant::Int8Rows;
using quant::kMaxRows;
using quant::kPrefetchBytes;
constexpr int64_t kLane = 4;  // weights per int32 lane of an integer dot product

#if !defined(__AVX2__)
// acc (kWidth float lanes) += the integer dot product of n weights q with x's quants xq,
// each 4-weight lane l scaled by its weights' scale g16[l / 4] times x_lane[l] (the scalar
// copy's int8 path; the others take quant_rows_int8.h).
inline void dot_int8(const int8_t* __restrict q, const int8_t* __restrict xq,
                     const float* __restrict g16, const float* __restrict x_lane, int64_t n,
                     float* __restrict acc) {
  for (int64_t l = 0; l < n / kLane; ++l) {
    int32_t s = 0;
    for (int64_t i = 0; i < kLane; ++i) s += int32_t{q[l * kLane + i]} * xq[l * kLane + i];
    acc[l % kWidth] += static_cast<float>(s) * (g16[l / 4] * x_lane[l]);
  }
}
#endif

// acc += x[0..n) * wf[0..n) in float32 (n a multiple of 32).
inline void dot_float(const float* __restrict x, const float* __restrict wf, int64_t n,
                      float* __restrict acc) {
  F a = F::loadu(acc);
  for (int64_t k = 0; k < n; k += kWidth) a = at::vec::fmadd(F::loadu(x + k), F::loadu(wf + k), a);
  a.store(acc);
}

// The chunk's weights as float32: q * (scale of its 16) + (constant of its 32).
inline void widen_chunk(const Chunk& c, int64_t len, float* __restrict wf) {
  for (int64_t g = 0; g < len / 16; ++g) {
    const float scale = c.g16[g], constant = c.min32[g / 2];
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i)
      wf[g * 16 + i] = static_cast<float>(c.q[g * 16 + i]) * scale + constant;
  }
}

// The chunk of `len` weights at k0 of `row` decoded into c, the blocks kPrefetchBytes
// ahead of it asked into L2 (not past `stop`, the end of the thread's rows).
template <QuantFormat Fmt>
inline void decode_chunk_prefetched(const uint8_t* row, int64_t k0, int64_t len,
                                    const char* stop, Chunk& c) {
  const uint8_t* bytes = row + k0 / quant::block_elems(Fmt) * quant::block_bytes(Fmt);
  const int64_t nbytes = len / quant::block_elems(Fmt) * quant::block_bytes(Fmt);
  for (int64_t off = 0; off < nbytes; off += 64) {
    const char* ahead = reinterpret_cast<const char*>(bytes + off) + kPrefetchBytes;
    if (ahead < stop) prefetch_l2(ahead);
  }
  quant::decode_chunk<Fmt>(row, k0, len, c);
}

#if !defined(__AVX2__)
// Rows [n_begin, n_end) of the output, for M <= kMaxRows rows of x (prefetching ahead up to
// row n_stop).
template <QuantFormat Fmt, typename TO>
void rows_int8(const QuantLinearArgs& a, const Int8Rows& xr, int64_t m0, int64_t M,
               int64_t n_begin, int64_t n_end, int64_t n_stop) {
  Chunk c;
  alignas(64) float acc[kMaxRows][kWidth];
  float mins[kMaxRows];
  const int64_t K = a.K;
  const char* stop = reinterpret_cast<const char*>(a.w + n_stop * a.w_row_bytes);
  TO* out = static_cast<TO*>(a.out);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = a.w + n * a.w_row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      std::fill_n(acc[m], kWidth, 0.0f);
      mins[m] = 0.0f;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t len = std::min(kChunk, K - k0);
      decode_chunk_prefetched<Fmt>(row, k0, len, stop, c);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t xm = (m0 + m) * K + k0;
        dot_int8(c.q, xr.q.data() + xm, c.g16, xr.lane_scale.data() + xm / kLane, len, acc[m]);
        if constexpr (quant::has_min(Fmt)) {
          const float* sums = xr.block_sum.data() + xm / kBlock;
          for (int64_t b = 0; b < len / kBlock; ++b) mins[m] += c.min32[b] * sums[b];
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const float y = hsum(F::loadu(acc[m])) + mins[m] + (a.bias != nullptr ? a.bias[n] : 0.0f);
      out[(m0 + m) * quant::out_stride(a) + n] = from_float<TO>(y);
    }
  }
}
#endif

#if defined(__AVX2__)
inline float hsum256(__m256 acc) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// The float path of the 32-block formats with the copies that have AVX2: each block widened
// to float32 in registers (q * d + constant, rounded as the reference rounds it) and
// multiplied at once, four independent FMA chains per row of x.
template <QuantFormat Fmt, typename TO, int MR>
void rows_float_small(const QuantLinearArgs& a, const float* x32, int64_t m0, int64_t M_rt,
                      int64_t n_begin, int64_t n_end, int64_t n_stop) {
  const int64_t M = MR > 0 ? MR : M_rt;
  const int64_t K = a.K, blocks = K / kBlock;
  constexpr int64_t bytes = quant::block_bytes(Fmt);
  constexpr int64_t rows = MR > 0 ? MR : kMaxRows;
  const char* stop = reinterpret_cast<const char*>(a.w + n_stop * a.w_row_bytes);
  TO* out = static_cast<TO*>(a.out);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = a.w + n * a.w_row_bytes;
    __m256 acc0[rows], acc1[rows], acc2[rows], acc3[rows];
    for (int64_t m = 0; m < M; ++m) acc0[m] = acc1[m] = acc2[m] = acc3[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < blocks; ++j) {
      const uint8_t* b = row + j * bytes;
      const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchBytes;
      if (ahead < stop) prefetch_l2(ahead);
      const __m256 d = _mm256_set1_ps(quant::half_at(b));
      const __m256 constant = _mm256_set1_ps(quant::has_min(Fmt) ? quant::half_at(b + 2) : 0.0f);
      const __m256i w = quant::small_block_q<Fmt>(b);
      const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
      auto widen8 = [&](__m128i q8) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
        return _mm256_add_ps(_mm256_mul_ps(q, d), constant);
      };
      const __m256 w0 = widen8(lo), w1 = widen8(_mm_srli_si128(lo, 8));
      const __m256 w2 = widen8(hi), w3 = widen8(_mm_srli_si128(hi, 8));
      for (int64_t m = 0; m < M; ++m) {
        const float* x = x32 + (m0 + m) * K + j * kBlock;
        acc0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, acc1[m]);
        acc2[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, acc2[m]);
        acc3[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, acc3[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc0[m], acc1[m]),
                                       _mm256_add_ps(acc2[m], acc3[m]));
      const float y = hsum256(sum) + (a.bias != nullptr ? a.bias[n] : 0.0f);
      out[(m0 + m) * quant::out_stride(a) + n] = from_float<TO>(y);
    }
  }
}
#endif

template <QuantFormat Fmt, typename TO>
void rows_float(const QuantLinearArgs& a, const float* x32, int64_t m0, int64_t M,
                int64_t n_begin, int64_t n_end, int64_t n_stop) {
  Chunk c;
  alignas(64) float wf[kChunk];
  alignas(64) float acc[kMaxRows][kWidth];
  const int64_t K = a.K;
  const char* stop = reinterpret_cast<const char*>(a.w + n_stop * a.w_row_bytes);
  TO* out = static_cast<TO*>(a.out);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = a.w + n * a.w_row_bytes;
    for (int64_t m = 0; m < M; ++m) std::fill_n(acc[m], kWidth, 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t len = std::min(kChunk, K - k0);
      decode_chunk_prefetched<Fmt>(row, k0, len, stop, c);
      widen_chunk(c, len, wf);
      for (int64_t m = 0; m < M; ++m) dot_float(x32 + (m0 + m) * K + k0, wf, len, acc[m]);
    }
    for (int64_t m = 0; m < M; ++m) {
      const float y = hsum(F::loadu(acc[m])) + (a.bias != nullptr ? a.bias[n] : 0.0f);
      out[(m0 + m) * quant::out_stride(a) + n] = from_float<TO>(y);
    }
  }
}

template <typename T>
std::vector<float> widen(const T* x, int64_t x_stride, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = to_float(x[m * x_stride + k]);
  return out;
}

// Rows [begin, end) of the output for rows [m0, m0 + M) of x, int8 activations, prefetching
// ahead up to row `stop` (`resumed`: the rows before were this thread's, and prefetched on).
template <QuantFormat Fmt, typename T>
void int8_rows(const QuantLinearArgs& a, const Int8Rows& xr, int64_t m0, int64_t M,
               int64_t begin, int64_t end, int64_t stop, bool resumed) {
#if defined(__AVX2__)
  quant::rows_int8_fast<Fmt, T>(a, xr, m0, M, begin, end, stop, resumed);
#else
  (void)resumed;
  rows_int8<Fmt, T>(a, xr, m0, M, begin, end, stop);
#endif
}

// Rows [0, N) split between the threads (work_share.h) in runs of whole 4-row groups (the
// groups the one-row-of-x loops take together), a few KiB of blocks per claim: fn(run) with
// the run in rows.
template <typename Fn>
void share_rows(int64_t N, int64_t row_bytes, const Fn& fn) {
  constexpr int64_t kGroup = 4;
  work_share::for_each_chunk(
      (N + kGroup - 1) / kGroup, work_share::chunk_units(kGroup * row_bytes),
      [&](const work_share::Run& r) {
        fn(work_share::Run{r.begin * kGroup, std::min(r.end * kGroup, N),
                           std::min(r.stop * kGroup, N), r.resumed});
      });
}

#if defined(__AVX2__)
constexpr int64_t kLeadBytes = 4096;  // of the weight asked for while x is rounded
#endif

// x rounded through int8 (this thread's buffers, reused by its next call), the first
// kLeadBytes of the weight `w` (`bytes` long) asked into L2 before the rounding, so that
// the first thread's stream has begun when the rows start (the copies with AVX2).
template <typename T>
const Int8Rows& rounded_x(const T* x, int64_t x_stride, int64_t M, int64_t K,
                          const uint8_t* w, int64_t bytes) {
#if defined(__AVX2__)
  quant::prefetch_lines(w, kLeadBytes, reinterpret_cast<const char*>(w + bytes));
#else
  (void)w, (void)bytes;
#endif
  thread_local Int8Rows rows;
  quant::quantize_rows_into(x, x_stride, M, K, rows);
  return rows;
}

template <QuantFormat Fmt, typename T>
void quant_linear_typed(const QuantLinearArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  if (a.int8_activations) {
    const Int8Rows& xr = rounded_x(x, a.x_stride, a.M, a.K, a.w, a.N * a.w_row_bytes);
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
      const int64_t M = std::min(kMaxRows, a.M - m0);
      share_rows(a.N, a.w_row_bytes, [&](const work_share::Run& r) {
        int8_rows<Fmt, T>(a, xr, m0, M, r.begin, r.end, r.stop, r.resumed);
      });
    }
  } else {
    std::vector<float> widened;
    const float* x32;
    if constexpr (std::is_same_v<T, float>) {
      if (a.x_stride == a.K) {
        x32 = x;
      } else {
        widened = widen(x, a.x_stride, a.M, a.K);
        x32 = widened.data();
      }
    } else {
      widened = widen(x, a.x_stride, a.M, a.K);
      x32 = widened.data();
    }
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
      const int64_t M = std::min(kMaxRows, a.M - m0);
      share_rows(a.N, a.w_row_bytes, [&](const work_share::Run& r) {
        const int64_t begin = r.begin, end = r.end, stop = r.stop;
#if defined(__AVX2__)
        if constexpr (quant::block_elems(Fmt) == kBlock) {
          if (M == 1) {
            rows_float_small<Fmt, T, 1>(a, x32, m0, M, begin, end, stop);
          } else {
            rows_float_small<Fmt, T, 0>(a, x32, m0, M, begin, end, stop);
          }
          return;
        }
#endif
        rows_float<Fmt, T>(a, x32, m0, M, begin, end, stop);
      });
    }
  }
}

template <typename T>
void quant_linear_parts_typed(const QuantLinearPartsArgs& p) {
  const QuantLinearArgs& first = p.parts[0];
  const Int8Rows& xr = rounded_x(static_cast<const T*>(first.x), first.x_stride, first.M,
                                 first.K, first.w, first.N * first.w_row_bytes);
  int64_t rows = 0;
  for (int64_t i = 0; i < p.count; ++i) rows += p.parts[i].N;
  for (int64_t m0 = 0; m0 < first.M; m0 += kMaxRows) {
    const int64_t M = std::min(kMaxRows, first.M - m0);
    share_rows(rows, first.w_row_bytes, [&](const work_share::Run& r) {
      int64_t start = 0;  // the part's first row among all the parts' rows
      for (int64_t i = 0; i < p.count; start += p.parts[i].N, ++i) {
        const int64_t lo = std::max(r.begin, start), hi = std::min(r.end, start + p.parts[i].N);
        if (lo >= hi) continue;
        const int64_t ahead = std::min(r.stop, start + p.parts[i].N);  // within this part
        const bool resumed = r.resumed && lo == r.begin;
        quant::with_format(p.parts[i].format, [&](auto fmt) {
          int8_rows<decltype(fmt)::value, T>(p.parts[i], xr, m0, M, lo - start, hi - start,
                                             ahead - start, resumed);
        });
      }
    });
  }
}

}  // namespace

void quant_linear_parts(const QuantLinearPartsArgs& p) {
  TORCH_CHECK(p.count > 0, "quant_linear_parts: no parts");
  const QuantLinearArgs& first = p.parts[0];
  for (int64_t i = 0; i < p.count; ++i) {
    const QuantLinearArgs& a = p.parts[i];
    TORCH_CHECK(a.int8_activations && a.x == first.x && a.M == first.M && a.K == first.K &&
                    a.dtype == first.dtype,
                "quant_linear_parts: part ", i, " does not share the first part's x, or has ",
                "float activations");
  }
  TORCH_CHECK(first.K % kBlock == 0, "quant_linear: ", first.K, " columns is not a multiple of 32");
  if (first.dtype == Dtype::f32) {
    quant_linear_parts_typed<float>(p);
  } else {
    TORCH_CHECK(first.dtype == Dtype::bf16, "quant_linear: float32 or bfloat16 activations only");
    quant_linear_parts_typed<BF16>(p);
  }
}

void quant_linear(const QuantLinearArgs& a) {
  TORCH_CHECK(a.K % kBlock == 0, "quant_linear: ", a.K, " columns is not a multiple of 32");
  quant::with_format(a.format, [&](auto fmt) {
    constexpr QuantFormat Fmt = decltype(fmt)::value;
    if (a.dtype == Dtype::f32) {
      quant_linear_typed<Fmt, float>(a);
    } else {
      TORCH_CHECK(a.dtype == Dtype::bf16, "quant_linear: float32 or bfloat16 activations only");
      quant_linear_typed<Fmt, BF16>(a);
    }
  });
}

PLUGSERVE_ISA_END
