// The few-row int8 dot products of the GGML formats on the AVX2 copy
// (included by quant_rows_int8.h; Q8_0 on the AVX-512 copies too): quant_dot_avx512.h's
// method, 32 weights per 256-bit register (one 32-block, or a sub-block of a K-quant
// superblock) multiplied with vpmaddubsw + vpmaddwd, or vpdpbusd with AVX512-VNNI (unsigned
// quants times x's int8 quants; Q8_0 without VNNI with the sign trick).
#pragma once

#include <cstdint>
#include <cstring>

PLUGSERVE_ISA_BEGIN
namespace quant {
#if defined(__AVX2__)
namespace v256 {

inline __m256i dot_u8s8(__m256i w, __m256i x, __m256i base = _mm256_setzero_si256()) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(base, w, x);
#else
  return _mm256_add_epi32(base, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                  _mm256_set1_epi16(1)));
#endif
}

inline __m256i minus_offset_dot(int offset, __m256i x) {
  const __m256i o = _mm256_set1_epi8(static_cast<char>(offset));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_sub_epi32(_mm256_setzero_si256(),
                          _mm256_dpbusd_epi32(_mm256_setzero_si256(), o, x));
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(o, x), _mm256_set1_epi16(-1));
#endif
}

inline __m256 fma_dot(__m256i w, const int8_t* x, __m256 scale, __m256 acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w, xv)), scale, acc);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- Q4_0, Q4_1, Q5_0, Q5_1: one block at a time ------------------------------------------
template <QuantFormat F, int R, int MR>
inline void small_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                       const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(F), at = small_qs_at(F);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m256 acc[R][RM];
  __m128 mins[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = _mm_setzero_ps();
  const __m256i shifts = _mm256_set_epi64x(4, 4, 0, 0);
  for (int64_t j = 0; j < x.blocks; ++j) {
    __m256i xv[RM], base[RM];
    __m128 xs[RM];
    for (int64_t m = 0; m < M; ++m) {
      xs[m] = _mm_castsi128_ps(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(x.scale_sum + (m * x.blocks + j) * 2)));
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * x.K + j * kBlock));
      // -offset * the sum of each lane's activations: the quants are stored as q + offset
      base[m] = quant_offset(F) != 0 ? minus_offset_dot(quant_offset(F), xv[m])
                                     : _mm256_setzero_si256();
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + j * bytes;
      const char* ahead = reinterpret_cast<const char*>(b) + kPrefetchBytes;
      if (ahead < stop) vec::prefetch_l2(ahead);
      __m256i w;
      if constexpr (F == QuantFormat::q8_0) {  // q + 128 as unsigned bytes with VNNI, else q
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        if constexpr (kVnni) w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
      } else {
        const __m256i t = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at)));
        w = _mm256_and_si256(_mm256_srlv_epi64(t, shifts), _mm256_set1_epi8(0x0F));
      }
      if constexpr (F == QuantFormat::q5_0 || F == QuantFormat::q5_1)
        w = _mm256_or_si256(w, bit4_from_bits_32(load_u32(b + at - 4)));
      // [d, m] (m = 0 without a min)
      const int bits = static_cast<int>(has_min(F) ? load_u32(b) : load_u32(b) & 0xFFFFu);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
      for (int64_t m = 0; m < M; ++m) {
        const __m128 s = _mm_mul_ps(dm, xs[m]);
        if constexpr (has_min(F)) mins[r][m] = _mm_add_ps(mins[r][m], s);
        const __m256i dot =
            F == QuantFormat::q8_0 && !kVnni  // the sign trick: |w| times x with w's sign
                ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                         _mm256_sign_epi8(xv[m], w)),
                                    _mm256_set1_epi16(1))
                : dot_u8s8(w, xv[m], base[m]);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcastss_ps(s), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) {
      const __m128 c = mins[r][m];
      y[r * M + m] = hsum8(acc[r][m]) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
    }
}

// ---- Q4_K, Q5_K -----------------------------------------------------------------------------
template <QuantFormat F, int R, int MR>
inline void k4_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                    const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(F);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m256 acc[R][RM], mins[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = mins[r][m] = _mm256_setzero_ps();
  const __m256i m0f = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < x.K / 256; ++s) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + s * bytes;
      prefetch_block_ahead(b, bytes, stop);
      const __m128i packed = k4_scales_mins(b + 4);
      const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)),
                                      _mm256_set1_ps(half_at(b)));
      const __m256 mn = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
          _mm256_set1_ps(half_at(b + 2)));
      __m256 p[RM];
      for (int64_t m = 0; m < M; ++m) {
        p[m] = _mm256_mul_ps(sc, _mm256_loadu_ps(x.block_scale + m * x.blocks + 8 * s));
        mins[r][m] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(x.block_sum + m * x.blocks + 8 * s),
                                     mins[r][m]);
      }
      const uint8_t* qs = b + (F == QuantFormat::q5_k ? 48 : 16);
      __m256i qh = _mm256_setzero_si256();
      if constexpr (F == QuantFormat::q5_k)
        qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int part = 0; part < 4; ++part) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * part));
        __m256i lo = _mm256_and_si256(v, m0f);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        if constexpr (F == QuantFormat::q5_k) {
          const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * part)));
          const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * part)));
          const __m256i sixteen = _mm256_set1_epi8(0x10);
          lo = _mm256_or_si256(lo, _mm256_and_si256(
              _mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(
              _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        const __m256i i0 = _mm256_set1_epi32(2 * part), i1 = _mm256_set1_epi32(2 * part + 1);
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* xq = x.q + m * x.K + 256 * s + 64 * part;
          acc[r][m] = fma_dot(lo, xq, _mm256_permutevar8x32_ps(p[m], i0), acc[r][m]);
          acc[r][m] = fma_dot(hi, xq + 32, _mm256_permutevar8x32_ps(p[m], i1), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) y[r * M + m] = hsum8(acc[r][m]) - hsum8(mins[r][m]);
}

// ---- Q6_K -----------------------------------------------------------------------------------
template <int R, int MR>
inline void q6k_rows(const uint8_t* row, int64_t row_bytes, const XRows& x, int64_t M_rt,
                     const char* stop, float* y) {
  constexpr int64_t bytes = block_bytes(QuantFormat::q6_k);
  constexpr int RM = MR > 0 ? MR : kMaxRows;
  const int64_t M = MR > 0 ? MR : M_rt;
  __m256 acc[R][RM], offs[R][RM];
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) acc[r][m] = offs[r][m] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i hi4 = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t s = 0; s < x.K / 256; ++s) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * row_bytes + s * bytes;
      prefetch_block_ahead(b, bytes, stop);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256 d = _mm256_set1_ps(half_at(b + 208));
      const __m256 sc0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), d);
      const __m256 sc1 = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))), d);
      __m256 p[RM][2];
      for (int64_t m = 0; m < M; ++m) {
        const __m256 dx = _mm256_loadu_ps(x.block_scale + m * x.blocks + 8 * s);
        const float* xsum = x.sum16 + m * (x.K / 16) + 16 * s;
        p[m][0] = _mm256_mul_ps(sc0, _mm256_permutevar8x32_ps(dx, lo4));
        p[m][1] = _mm256_mul_ps(sc1, _mm256_permutevar8x32_ps(dx, hi4));
        offs[r][m] = _mm256_fmadd_ps(p[m][0], _mm256_loadu_ps(xsum), offs[r][m]);
        offs[r][m] = _mm256_fmadd_ps(p[m][1], _mm256_loadu_ps(xsum + 8), offs[r][m]);
      }
      for (int half = 0; half < 2; ++half) {
        const uint8_t* l = b + 64 * half;
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
        const __m256i hv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
        auto quants = [&](__m256i low4, __m256i high2) {
          return _mm256_or_si256(_mm256_and_si256(low4, m0f), _mm256_and_si256(high2, m30));
        };
        const __m256i w[4] = {quants(l0, _mm256_slli_epi16(hv, 4)),
                              quants(l1, _mm256_slli_epi16(hv, 2)),
                              quants(_mm256_srli_epi16(l0, 4), hv),
                              quants(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hv, 2))};
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* xq = x.q + m * x.K + 256 * s + 128 * half;
          for (int c = 0; c < 4; ++c) {  // groups 2c, 2c + 1 of this half
            const __m256 sc = _mm256_permutevar8x32_ps(
                p[m][half], _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1,
                                              2 * c + 1, 2 * c + 1));
            acc[r][m] = fma_dot(w[c], xq + 32 * c, sc, acc[r][m]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m)
      y[r * M + m] = hsum8(acc[r][m]) - 32.0f * hsum8(offs[r][m]);
}

}  // namespace v256
#endif
}  // namespace quant
PLUGSERVE_ISA_END
