// The GGML block formats decoded a chunk at a time (included by quant_linear.cpp inside its
// ISA namespace): a chunk is kChunk consecutive weights of one row (one K-quant superblock, or
// up to 8 blocks of 32), decoded into
//   q[k]      signed int8 quants,
//   g16[g]    the scale of each 16 weights (a sub-block scale times the block's d),
//   min32[b]  the constant added to each weight of a 32-block (0 for the symmetric formats),
// so that weight k is q[k] * g16[k / 16] + min32[k / 32], the value gguf.quants.dequantize
// gives (llama.cpp's block layouts, ggml-common.h). Plain loops over the block bytes, which
// the compiler vectorises for the ISA of the copy.
#pragma once

#include <cstdint>
#include <cstring>

PLUGSERVE_ISA_BEGIN
namespace quant {

constexpr int64_t kChunk = 256;
constexpr int64_t kBlock = 32;  // the activation block: a divisor of every format's block

struct Chunk {
  alignas(64) int8_t q[kChunk];
  alignas(64) float g16[kChunk / 16];
  alignas(64) float min32[kChunk / kBlock];
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return vec::to_float(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int64_t block_bytes(QuantFormat f) { return quant_block_bytes(f); }
constexpr int64_t block_elems(QuantFormat f) { return quant_block_elems(f); }
constexpr bool has_min(QuantFormat f) {
  return f == QuantFormat::q4_1 || f == QuantFormat::q5_1 || f == QuantFormat::q4_k ||
         f == QuantFormat::q5_k;
}

#if defined(__AVX2__)
// The copies with AVX2 (avx2 and the AVX-512 ones) unpack with 256-bit integer instructions:
// the compiler turns the plain nibble loops into byte inserts.
inline __m256i nibbles_16(const uint8_t* p) {  // 16 bytes: low nibbles, then high nibbles
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// 0x10 in byte i where bit i of the 32-bit word is set (llama.cpp's bytes_from_bits_32).
inline __m256i bit4_from_bits_32(uint32_t bits) {
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                          _mm256_set1_epi8(0x10));
}
inline void store32(int8_t* q, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
}

// The 32 signed quants of a block of one of the small formats.
template <QuantFormat F>
inline __m256i small_block_q(const uint8_t* b) {
  if constexpr (F == QuantFormat::q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    constexpr bool five = F == QuantFormat::q5_0 || F == QuantFormat::q5_1;
    constexpr bool with_min = F == QuantFormat::q4_1 || F == QuantFormat::q5_1;
    constexpr int64_t qs_at = (with_min ? 4 : 2) + (five ? 4 : 0);
    __m256i v = nibbles_16(b + qs_at);
    if constexpr (five) {
      uint32_t qh;
      std::memcpy(&qh, b + qs_at - 4, 4);
      v = _mm256_or_si256(v, bit4_from_bits_32(qh));
    }
    if constexpr (F == QuantFormat::q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    if constexpr (F == QuantFormat::q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    return v;
  }
}
#endif

// One 32-weight block of the small formats into q[0..32), its d into both g16 entries.
template <QuantFormat F>
inline void decode_small(const uint8_t* b, int8_t* __restrict q, float* g16, float* min32) {
  const float d = half_at(b);
  g16[0] = g16[1] = d;
  *min32 = 0.0f;
#if defined(__AVX2__)
  if constexpr (F == QuantFormat::q4_1 || F == QuantFormat::q5_1) *min32 = half_at(b + 2);
  store32(q, small_block_q<F>(b));
  return;
#endif
  if constexpr (F == QuantFormat::q8_0) {
    std::memcpy(q, b + 2, 32);
  } else if constexpr (F == QuantFormat::q4_0 || F == QuantFormat::q4_1) {
    const uint8_t* qs = b + (F == QuantFormat::q4_0 ? 2 : 4);
    const int8_t off = F == QuantFormat::q4_0 ? 8 : 0;
    if constexpr (F == QuantFormat::q4_1) *min32 = half_at(b + 2);
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<int8_t>((qs[i] & 0x0F) - off);
      q[i + 16] = static_cast<int8_t>((qs[i] >> 4) - off);
    }
  } else {  // q5_0 / q5_1: the fifth bits in a 32-bit word, bit i for weight i
    const int64_t at = F == QuantFormat::q5_0 ? 2 : 4;
    if constexpr (F == QuantFormat::q5_1) *min32 = half_at(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + at, 4);
    const uint8_t* qs = b + at + 4;
    const int8_t off = F == QuantFormat::q5_0 ? 16 : 0;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 0x0F) | static_cast<int>(((qh >> i) & 1u) << 4);
      const int hi = (qs[i] >> 4) | static_cast<int>(((qh >> (i + 16)) & 1u) << 4);
      q[i] = static_cast<int8_t>(lo - off);
      q[i + 16] = static_cast<int8_t>(hi - off);
    }
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K superblock (get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One 256-weight superblock of a K-quant format.
template <QuantFormat F>
inline void decode_k(const uint8_t* b, Chunk& c) {
  if constexpr (F == QuantFormat::q6_k) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int g = 0; g < 16; ++g) c.g16[g] = d * static_cast<float>(sc[g]);
    for (int b32 = 0; b32 < 8; ++b32) c.min32[b32] = 0.0f;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* l = ql + 64 * half;
      const uint8_t* h = qh + 32 * half;
      int8_t* q = c.q + 128 * half;
#if defined(__AVX2__)
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
      const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
      const __m256i off = _mm256_set1_epi8(32);
      auto put = [&](int8_t* dst, __m256i low4, __m256i high2) {
        store32(dst, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(low4, m4),
                                                     _mm256_and_si256(high2, m2)), off));
      };
      put(q, l0, _mm256_slli_epi16(hv, 4));
      put(q + 32, l1, _mm256_slli_epi16(hv, 2));
      put(q + 64, _mm256_srli_epi16(l0, 4), hv);
      put(q + 96, _mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hv, 2));
      continue;
#endif
      for (int i = 0; i < 32; ++i) {
        q[i] = static_cast<int8_t>(((l[i] & 0x0F) | (((h[i] >> 0) & 3) << 4)) - 32);
        q[i + 32] = static_cast<int8_t>(((l[i + 32] & 0x0F) | (((h[i] >> 2) & 3) << 4)) - 32);
        q[i + 64] = static_cast<int8_t>(((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32);
        q[i + 96] = static_cast<int8_t>(((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32);
      }
    }
  } else {  // q4_k / q5_k: d, dmin, 12 bytes of 6-bit scales and mins, [qh,] qs
    const float d = half_at(b);
    const float dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, scales, sc, m);
      c.g16[2 * j] = c.g16[2 * j + 1] = d * static_cast<float>(sc);
      c.min32[j] = -(dmin * static_cast<float>(m));
    }
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (F == QuantFormat::q5_k ? 48 : 16);
    for (int part = 0; part < 4; ++part) {  // 64 weights: the low then the high nibbles
      const uint8_t* l = qs + 32 * part;
      int8_t* q = c.q + 64 * part;
#if defined(__AVX2__)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      __m256i lo = _mm256_and_si256(v, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if constexpr (F == QuantFormat::q5_k) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
        const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * part)));
        const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * part)));
        const __m256i sixteen = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(h, b0), b0), sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(h, b1), b1), sixteen));
      }
      store32(q, lo);
      store32(q + 32, hi);
      continue;
#endif
      for (int i = 0; i < 32; ++i) {
        int lo = l[i] & 0x0F, hi = l[i] >> 4;
        if constexpr (F == QuantFormat::q5_k) {
          lo |= ((qh[i] >> (2 * part)) & 1) << 4;
          hi |= ((qh[i] >> (2 * part + 1)) & 1) << 4;
        }
        q[i] = static_cast<int8_t>(lo);
        q[i + 32] = static_cast<int8_t>(hi);
      }
    }
  }
}

// Weights [k0, k0 + n) of a row (k0 a multiple of kChunk, n <= kChunk a multiple of the
// format's block) into c.
template <QuantFormat F>
inline void decode_chunk(const uint8_t* row, int64_t k0, int64_t n, Chunk& c) {
  const uint8_t* b = row + k0 / block_elems(F) * block_bytes(F);
  if constexpr (block_elems(F) == 256) {
    decode_k<F>(b, c);
  } else {
    for (int64_t j = 0; j < n / kBlock; ++j)
      decode_small<F>(b + j * block_bytes(F), c.q + j * kBlock, c.g16 + 2 * j, c.min32 + j);
  }
}

// Call `fn` with F the format `f` as a template argument.
template <typename Fn>
inline void with_format(QuantFormat f, Fn&& fn) {
  switch (f) {
    case QuantFormat::q8_0: fn(std::integral_constant<QuantFormat, QuantFormat::q8_0>{}); break;
    case QuantFormat::q4_0: fn(std::integral_constant<QuantFormat, QuantFormat::q4_0>{}); break;
    case QuantFormat::q4_1: fn(std::integral_constant<QuantFormat, QuantFormat::q4_1>{}); break;
    case QuantFormat::q5_0: fn(std::integral_constant<QuantFormat, QuantFormat::q5_0>{}); break;
    case QuantFormat::q5_1: fn(std::integral_constant<QuantFormat, QuantFormat::q5_1>{}); break;
    case QuantFormat::q4_k: fn(std::integral_constant<QuantFormat, QuantFormat::q4_k>{}); break;
    case QuantFormat::q5_k: fn(std::integral_constant<QuantFormat, QuantFormat::q5_k>{}); break;
    case QuantFormat::q6_k: fn(std::integral_constant<QuantFormat, QuantFormat::q6_k>{}); break;
  }
}

}  // namespace quant
PLUGSERVE_ISA_END
