// The few-row int8 dot products of the 4-, 5- and 6-bit GGML formats on the AVX-512 copies
// (included by quant_rows_int8.h). 64 weights per 512-bit register: two 32-blocks of the
// small formats, or a 64-weight part of a K-quant superblock, unpacked without byte shuffles
// (a 128/256-bit broadcast load, one per-qword variable shift, one mask) into *unsigned*
// quants that multiply x's int8 quants directly (vpdpbusd on AVX512-VNNI, else vpmaddubsw +
// vpmaddwd). The quants' offsets (-8, -16, -32) and the blocks' mins come out of the x
// blocks' sums instead (Int8Rows), once per block. Block scales are converted a block pair or
// a superblock at a time and spread over the lanes with one vpermps; each (weight row, x row)
// keeps one float32 accumulator, summed across lanes once at the end.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

PLUGSERVE_ISA_BEGIN
namespace quant {
#if defined(CPU_CAPABILITY_AVX512)
namespace v512 {

// base + the int32 dot products of 64 unsigned weights (0..63, or 0..255 with VNNI) with 64
// int8 activations, four per lane.
inline __m512i dot_u8s8(__m512i w, __m512i x, __m512i base = _mm512_setzero_si512()) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(base, w, x);
#else
  return _mm512_add_epi32(base, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x),
                                                  _mm512_set1_epi16(1)));
#endif
}

// -offset times the sum of each lane's four activations: the base that makes dot_u8s8 of
// quants stored as q + offset the exact integer dot product of q.
inline __m512i minus_offset_dot(int offset, __m512i x) {
  const __m512i o = _mm512_set1_epi8(static_cast<char>(offset));
#if defined(__AVX512VNNI__)
  return _mm512_sub_epi32(_mm512_setzero_si512(),
                          _mm512_dpbusd_epi32(_mm512_setzero_si512(), o, x));
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(o, x), _mm512_set1_epi16(-1));
#endif
}

// 16-lane float32 index vector: lane i reads element idx[i / 4] (four lanes per index).
inline __m512i lanes_of4(int a, int b, int c, int d) {
  return _mm512_set_epi32(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a);
}
inline __m512i lanes_of8(int a, int b) {
  return _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

// 64 nibbles out of `t` holding 32 bytes twice (per 128-bit lane: low nibbles in lanes 0 and
// 2 when Pairs, else in lanes 0-1; high nibbles in the others).
inline __m512i nibbles(__m512i t, __m512i shifts) {
  return _mm512_and_si512(_mm512_srlv_epi64(t, shifts), _mm512_set1_epi8(0x0F));
}

// ---- Q4_0, Q4_1, Q5_0, Q5_1 (and Q8_0 with VNNI): blocks j and j + 1 (Two) or j alone -----
template <QuantFormat F, bool Two>
inline __m512i small_pair_q(const uint8_t* b) {
  constexpr int64_t at = small_qs_at(F), bytes = block_bytes(F);
  if constexpr (F == QuantFormat::q8_0) {  // q + 128 as unsigned bytes: q ^ 0x80
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    __m512i t = _mm512_zextsi256_si512(lo);
    if constexpr (Two)
      t = _mm512_inserti64x4(
          t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + bytes + 2)), 1);
    return _mm512_xor_si512(t, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at)));
  if constexpr (Two)
    t = _mm512_mask_broadcast_i32x4(
        t, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bytes + at)));
  __m512i w = nibbles(t, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
  if constexpr (F == QuantFormat::q5_0 || F == QuantFormat::q5_1) {
    uint64_t bits = load_u32(b + at - 4);
    if constexpr (Two) bits |= uint64_t{load_u32(b + bytes + at - 4)} << 32;
    w = _mm512_mask_add_epi8(w, _cvtu64_mask64(bits), w, _mm512_set1_epi8(0x10));
  }
  return w;
}

template <QuantFormat F, bool Two>
inline __m128 small_pair_dm(const uint8_t* b) {  // [d0, m0, d1, m1] (m = 0 without a min)
  __m128i h = _mm_cvtsi32_si128(static_cast<int>(load_u32(b)));
  if constexpr (Two) h = _mm_insert_epi32(h, static_cast<int>(load_u32(b + block_bytes(F))), 1);
  if constexpr (!has_min(F)) h = _mm_and_si128(h, _mm_set1_epi32(0xFFFF));
  return _mm_cvtph_ps(h);
}

// y[r * M + m] = row r of the weight (R rows, row_bytes apart) . row m of x.
template <QuantFormat F, int R, int MR>
inline void small_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                       const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(F);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m512 acc[R][RM];
  __m128 mins[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = _mm_setzero_ps();
  const __m512i spread = lanes_of8(0, 2);
  auto step = [&](int64_t j, auto two) {
    constexpr bool Two = decltype(two)::value;
    __m512i xv[RM], base[RM];
    __m128 xs[RM];
    for (int64_t m = 0; m < M; ++m) {
      const float* ss = x.scale_sum + (m * x.blocks + j) * 2;
      xs[m] = Two ? _mm_loadu_ps(ss)
                  : _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ss)));
      const int8_t* xq = x.q + m * x.K + j * kBlock;
      xv[m] = Two ? _mm512_loadu_si512(xq) : _mm512_maskz_loadu_epi8(0xFFFFFFFFu, xq);
      base[m] = quant_offset(F) != 0 ? minus_offset_dot(quant_offset(F), xv[m])
                                     : _mm512_setzero_si512();
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + j * bytes;
      const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchBytes;
      if (ahead < stop) vec::prefetch_l2(ahead);
      const __m512i w = small_pair_q<F, Two>(b);
      const __m128 dm = small_pair_dm<F, Two>(b);
      for (int64_t m = 0; m < M; ++m) {
        const __m128 s = _mm_mul_ps(dm, xs[m]);
        if constexpr (has_min(F)) mins[r][m] = _mm_add_ps(mins[r][m], s);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(w, xv[m], base[m])),
                                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s)),
                                    acc[r][m]);
      }
    }
  };
  int64_t j = 0;
  for (; j + 2 <= x.blocks; j += 2) step(j, std::true_type{});
  if (j < x.blocks) step(j, std::false_type{});
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) {
      const __m128 c = mins[r][m];
      y[r * M + m] = _mm512_reduce_add_ps(acc[r][m]) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1)) +
                     _mm_cvtss_f32(_mm_shuffle_ps(c, c, 3));
    }
}

// ---- Q4_K, Q5_K: per superblock 8 sub-blocks of 32, 6-bit scales and mins -----------------
template <QuantFormat F, int R, int MR>
inline void k4_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                    const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(F);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m512 acc[R][RM], mins[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = mins[r][m] = _mm512_setzero_ps();
  const __m512i halves = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  for (int64_t s = 0; s < x.K / 256; ++s) {
    __m512 xs[RM];  // [dx of the 8 blocks, dx * sum(xq) of the 8 blocks]
    for (int64_t m = 0; m < M; ++m)
      xs[m] = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_loadu_ps(x.block_scale + m * x.blocks + 8 * s)),
          _mm256_loadu_ps(x.block_sum + m * x.blocks + 8 * s), 1);
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + s * bytes;
      prefetch_block_ahead(b, bytes, stop);
      const __m512 dd = _mm512_permutexvar_ps(
          lanes_of8(0, 1), _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(
                                static_cast<int>(load_u32(b))))));
      const __m512 sm = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales_mins(b + 4))), dd);
      __m512i qh = _mm512_setzero_si512();
      if constexpr (F == QuantFormat::q5_k)
        qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
      const uint8_t* qs = b + (F == QuantFormat::q5_k ? 48 : 16);
      __m512 p[RM];
      for (int64_t m = 0; m < M; ++m) {
        p[m] = _mm512_mul_ps(sm, xs[m]);
        mins[r][m] = _mm512_add_ps(mins[r][m], p[m]);
      }
      for (int part = 0; part < 4; ++part) {
        __m512i w = nibbles(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(qs + 32 * part))), halves);
        if constexpr (F == QuantFormat::q5_k) {
          const __m512i bit =  // the part's fifth bits: 2 * part (low nibbles), 2 * part + 1
              _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * part))),
                                 _mm256_set1_epi8(static_cast<char>(2 << (2 * part))), 1);
          w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, bit), w, _mm512_set1_epi8(0x10));
        }
        const __m512i spread = lanes_of8(2 * part, 2 * part + 1);
        for (int64_t m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(x.q + m * x.K + 256 * s + 64 * part);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(w, xv)),
                                      _mm512_permutexvar_ps(spread, p[m]), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m)
      y[r * M + m] = _mm512_reduce_add_ps(acc[r][m]) -
                     _mm512_mask_reduce_add_ps(__mmask16(0xFF00), mins[r][m]);
}

// ---- Q6_K: per superblock 16 groups of 16, int8 scales, quants 0..63 less 32 ---------------
template <int R, int MR>
inline void q6k_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                     const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(QuantFormat::q6_k);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m512 acc[R][RM], offs[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = offs[r][m] = _mm512_setzero_ps();
  const __m512i to16 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
  const __m512i shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i m30 = _mm512_set1_epi8(0x30), m0f = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < x.K / 256; ++s) {
    __m512 dx[RM], xsum[RM];
    for (int64_t m = 0; m < M; ++m) {
      dx[m] = _mm512_permutexvar_ps(
          to16, _mm512_castps256_ps512(_mm256_loadu_ps(x.block_scale + m * x.blocks + 8 * s)));
      xsum[m] = _mm512_loadu_ps(x.sum16 + m * (x.K / 16) + 16 * s);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + s * bytes;
      prefetch_block_ahead(b, bytes, stop);
      const __m512 sc = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
          _mm512_set1_ps(half_at(b + 208)));
      __m512 p[RM];
      for (int64_t m = 0; m < M; ++m) {
        p[m] = _mm512_mul_ps(sc, dx[m]);
        offs[r][m] = _mm512_fmadd_ps(p[m], xsum[m], offs[r][m]);
      }
      for (int half = 0; half < 2; ++half) {
        const __m512i l = _mm512_loadu_si512(b + 64 * half);
        const __m512i h = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half)));
        // (a & 0x0F) | b: vpternlogd with a, b, c = 0x0F
        const __m512i w0 = _mm512_ternarylogic_epi32(
            l, _mm512_and_si512(_mm512_sllv_epi64(h, shl), m30), m0f, 0xEC);
        const __m512i w1 = _mm512_ternarylogic_epi32(
            _mm512_srli_epi16(l, 4), _mm512_and_si512(_mm512_srlv_epi64(h, shr), m30), m0f, 0xEC);
        const int g = 8 * half;
        const __m512i spread0 = lanes_of4(g, g + 1, g + 2, g + 3);
        const __m512i spread1 = lanes_of4(g + 4, g + 5, g + 6, g + 7);
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* xq = x.q + m * x.K + 256 * s + 128 * half;
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(w0, _mm512_loadu_si512(xq))),
                                      _mm512_permutexvar_ps(spread0, p[m]), acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(dot_u8s8(w1, _mm512_loadu_si512(xq + 64))),
              _mm512_permutexvar_ps(spread1, p[m]), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m)
      y[r * M + m] = _mm512_reduce_add_ps(acc[r][m]) - 32.0f * _mm512_reduce_add_ps(offs[r][m]);
}

}  // namespace v512
#endif
}  // namespace quant
PLUGSERVE_ISA_END
