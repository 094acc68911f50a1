// Causal bf16 prefill attention on AMX tiles (Sapphire Rapids and later): the semantics of
// prefill_attention.cpp (prefix, sliding window, GQA; softmax in float32, out in bf16) with
// both products on the tiles, for head_dim a multiple of 32.
//
// A task is one kv head and a block of 16 query tokens (16 rows per query head of the
// group). It walks the keys the block sees in steps of 256 (the last step shorter, to the
// 16-key tile), and per step runs three phases over the group's heads, so that a tile load
// never waits on a vector store still in flight (and the reverse):
//  - scores, per head: 4 C tiles (16 tokens x 16 keys each) at a time, Q (A tile: 16 tokens
//    x 32 dims) times K (B tile: 16 dim pairs x 16 keys; K packed once per call), stored
//    as float32 [16][256];
//  - online softmax per row in float32 AVX-512 (running max and sum, base 2), exp2 by a
//    degree-4 polynomial (3.6e-6 relative, far below the bf16 rounding of the probabilities
//    that follows), the probabilities rounded to bf16 into [16][256] (the A operand of the
//    next product); the row's accumulator takes the previous step's P.V then:
//    o = (o + pv) * 2^(m_old - m_new);
//  - P.V, per head: C tiles zeroed, += P (A tile: 16 tokens x 32 keys) times V (B tile: 16
//    key pairs x 16 dims; V packed once per call), stored as the step's pv [16][D].
// Key steps outside every row's range are never visited; the masked lanes of the steps that
// cross a row's range (the diagonal, the window's edge) get probability 0. Tasks are taken
// first, last, second, second-to-last, ... per kv head, so the two halves at::parallel_for
// hands out have about the same causal work.
//
// Measured (benchmarks/prefill_attention_speed.py, 2-core Xeon with AMX, 9 / 3 heads of 64,
// ms per layer, four runs): 0.45-0.56 at 512 tokens and 1.51-1.99 at 1,024 against SDPA's
// 0.79-0.91 and 2.52-2.82 (1.4-1.8x). Tried and not faster: steps of 64, 128 or 512 keys; a
// pipeline interleaving each head's softmax rows with the tile work of its neighbours; each
// K / V tile loaded once for all heads of the group; 32-key score passes on alternating
// tiles; a degree-3 exp2 (core/kernels/README.md).
//
// Compiled with the AMX flags only into the avx512_bf16 copy (plugserve.kernels.isa:
// PLUGSERVE_AMX); every other copy, a CPU or OS without AMX, another dtype or head_dim
// returns false and the caller runs prefill_attention.cpp or SDPA.
#include <ATen/Parallel.h>

#include <limits>
#include <memory>
#include <vector>

#include "../vec/pvec.h"
#include "amx_tiles.h"

PLUGSERVE_ISA_BEGIN

#if defined(PLUGSERVE_AMX)
namespace {

using vec::BF16;

constexpr int64_t kRows = 16;       // query tokens per task: the rows of a tile
constexpr int64_t kKeyTile = 16;    // keys per score tile
constexpr int64_t kBlockKeys = 256;  // keys per online-softmax step: sixteen score tiles
constexpr int64_t kTileGroup = 64;  // keys per pass of the four C tiles over the scores
constexpr int64_t kChunk = 32;      // bf16 values along the product's K per A tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// n zeroed values of T at a 64-byte aligned address, with std::vector's begin / end / [].
template <typename T>
class Aligned {
 public:
  explicit Aligned(int64_t n)
      : n_(n), p_(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    std::memset(static_cast<void*>(p_.get()), 0, n * sizeof(T));
  }
  T* begin() { return p_.get(); }
  T* end() { return p_.get() + n_; }
  T& operator[](int64_t i) { return p_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  int64_t n_;
  std::unique_ptr<T, Free> p_;
};

struct Shape : PrefillShape {
  using PrefillShape::PrefillShape;
  int64_t padded = 0;  // keys in each pack: a whole block past the last 16-key tile (zeros)
  int64_t blocks = 0;  // query blocks per kv head
};

// K of kv head h, keys [first, first + 16) counted from key_lo, as D / 32 B tiles: tile c
// holds 16 rows (dim pairs 16c ..) of 16 keys x 2 dims. The 32-bit pairs of 16 key rows
// transposed at once.
void pack_k_tile(const PrefillArgs& a, const Shape& s, int64_t h, int64_t first, BF16* dst) {
  const BF16* k = static_cast<const BF16*>(a.k);
  for (int64_t c = 0; c < s.dim / kChunk; ++c) {
    __m512i r[16];
    for (int64_t i = 0; i < kKeyTile; ++i) {
      const int64_t key = first + i;
      r[i] = key < s.keys ? _mm512_loadu_si512(k + (s.key_lo + key) * a.k_token_stride +
                                               h * a.k_head_stride + c * kChunk)
                          : _mm512_setzero_si512();
    }
    amx::transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (c * 16 + p) * 32, r[p]);
  }
}

// V of kv head h, keys [first, first + 16) as pairs of keys: for dim chunk dc (16 dims),
// row first / 2 + j of the chunk's run holds (V[2j][16dc + i], V[2j + 1][16dc + i]) for
// i < 16. A B tile is then 16 consecutive rows (32 keys) of one chunk's run.
void pack_v_tile(const PrefillArgs& a, const Shape& s, int64_t h, int64_t first, BF16* run) {
  const BF16* v = static_cast<const BF16*>(a.v);
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const auto row = [&](int64_t key, int64_t dc) {
    return key < s.keys ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                              v + (s.key_lo + key) * a.v_token_stride + h * a.v_head_stride +
                              dc * 16))
                        : _mm256_setzero_si256();
  };
  for (int64_t dc = 0; dc < s.dim / 16; ++dc) {
    BF16* chunk = run + dc * (s.padded / 2) * 32;
    for (int64_t j = 0; j < kKeyTile / 2; ++j) {
      const int64_t key = first + 2 * j;
      const __m512i both =
          _mm512_inserti64x4(_mm512_castsi256_si512(row(key, dc)), row(key + 1, dc), 1);
      _mm512_storeu_si512(chunk + (key / 2) * 32, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// 2^x for x <= 0 (3.6e-6 relative; 0 far below the range): 2^round(x) times a degree-4
// polynomial of the rest.
inline __m512 exp2_poly(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(9.676037098e-03f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.592203565e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402210736e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931210340e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.000000075e+00f));
  return _mm512_scalef_ps(y, n);
}

// Lanes [lo, hi) of a 16-key tile, lo and hi clamped to it.
inline __mmask16 lanes(int64_t lo, int64_t hi) {
  lo = std::clamp<int64_t>(lo, 0, 16);
  hi = std::clamp<int64_t>(hi, 0, 16);
  const uint32_t upto_hi = (1u << hi) - 1, below_lo = (1u << lo) - 1;
  return static_cast<__mmask16>(upto_hi & ~below_lo);
}

// One row's online-softmax step: s holds its raw scores for the block's first 16 n_tiles
// keys, [vis0, vis1) of them visible. Writes the bf16 probabilities to prob (up to a whole
// 32-key chunk, zero outside the visible range), moves the running max m (of scaled scores,
// base 2) and sum l, and adds the previous block's products pv [D] into the row's
// accumulator o [D], rescaled by 2^(m_old - m_new): o = (o + pv) * alpha.
inline void softmax_row(const float* s, uint16_t* prob, int64_t n_tiles, int64_t vis0,
                        int64_t vis1, float c, float& m, float& l, float* o, const float* pv,
                        int64_t D) {
  const bool all = vis0 == 0 && vis1 == n_tiles * kKeyTile;
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t = 0; t < n_tiles; ++t) {
    const __mmask16 mask = all ? __mmask16(0xFFFF) : lanes(vis0 - t * 16, vis1 - t * 16);
    vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_loadu_ps(s + t * 16));
  }
  const int64_t chunk_tiles = (n_tiles + 1) / 2 * 2;  // P.V reads whole 32-key chunks
  const float block_max = _mm512_reduce_max_ps(vmax) * c;
  if (block_max == kNegInf) {  // nothing visible to this row here
    std::memset(prob, 0, chunk_tiles * kKeyTile * 2);
    for (int64_t d = 0; d < D; d += 16) {
      _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_loadu_ps(o + d), _mm512_loadu_ps(pv + d)));
    }
    return;
  }
  const float m_new = std::max(m, block_max);
  // The first block a row sees has m = -inf and zero accumulators and sum: alpha is moot.
  const float alpha =
      m == kNegInf ? 0.f : _mm512_cvtss_f32(exp2_poly(_mm512_set1_ps(m - m_new)));
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n_tiles; ++t) {
    __m512 e = exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(s + t * 16), vc, vm));
    if (!all) e = _mm512_maskz_mov_ps(lanes(vis0 - t * 16, vis1 - t * 16), e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + t * 16),
                        (__m256i)_mm512_cvtneps_pbh(e));
    // The sum adds the values before their rounding to bf16 (unbiased, 2^-9 relative
    // each): widening the rounded ones back would cost two more instructions a vector.
    sum = _mm512_add_ps(sum, e);
  }
  if (chunk_tiles > n_tiles) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + n_tiles * 16), _mm256_setzero_si256());
  }
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 sum_o = _mm512_add_ps(_mm512_loadu_ps(o + d), _mm512_loadu_ps(pv + d));
    _mm512_storeu_ps(o + d, _mm512_mul_ps(sum_o, va));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
}

// scores [16][kBlockKeys] = q [16][D] . keys [b0, b0 + 16 n_tiles) of a K pack, in passes
// of 64 keys (the last one may run past n_tiles into the pack's padding); tiles 0-3 C, 4 A,
// 5-7 B.
inline void score_tiles(const BF16* q, int64_t D, const BF16* kpack, int64_t b0, int64_t n_tiles,
                        float* scores) {
  const int64_t chunks = D / kChunk;
  constexpr int64_t stride = kBlockKeys * 4;
  for (int64_t t0 = 0; t0 < n_tiles; t0 += 4) {
    const BF16* kt = kpack + (b0 / kKeyTile + t0) * chunks * amx::kTileElems;
    const auto tile = [&](int64_t t, int64_t c) { return kt + (t * chunks + c) * amx::kTileElems; };
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, q + c * kChunk, D * 2);
      _tile_loadd(5, tile(0, c), 64);
      _tile_loadd(6, tile(1, c), 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(7, tile(2, c), 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, tile(3, c), 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* st = scores + t0 * kKeyTile;
    _tile_stored(0, st, stride);
    _tile_stored(1, st + 16, stride);
    _tile_stored(2, st + 32, stride);
    _tile_stored(3, st + 48, stride);
  }
}

// pv [16][D] = prob [16][kBlockKeys] . values [b0, b0 + 16 n_tiles) of a V pack, in 32-key
// chunks (prob is zero past n_tiles up to the chunk's end).
inline void value_tiles(const uint16_t* prob, int64_t n_tiles, const BF16* vpack, int64_t padded,
                        int64_t b0, float* o, int64_t D) {
  const int64_t key_chunks = (n_tiles + 1) / 2;
  const auto tile = [&](int64_t dc, int64_t kc) {
    return vpack + (dc * (padded / 2) + (b0 + kc * kChunk) / 2) * 32;
  };
  const int64_t o_stride = D * 4;
  for (int64_t d0 = 0; d0 < D / 16; d0 += 4) {
    // D / 16 is even (D % 32 == 0): the last group may hold 2 chunks of dims.
    const bool four = D / 16 - d0 >= 4;
    float* od = o + d0 * 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < key_chunks; ++kc) {
      _tile_loadd(4, prob + kc * kChunk, kBlockKeys * 2);
      _tile_loadd(5, tile(d0, kc), 64);
      _tile_loadd(6, tile(d0 + 1, kc), 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      if (four) {
        _tile_loadd(7, tile(d0 + 2, kc), 64);
        _tile_loadd(5, tile(d0 + 3, kc), 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, od, o_stride);
    _tile_stored(1, od + 16, o_stride);
    if (four) {
      _tile_stored(2, od + 32, o_stride);
      _tile_stored(3, od + 48, o_stride);
    }
  }
}

void attend(const PrefillArgs& a, const Shape& s, const BF16* kpack, const BF16* vpack) {
  const int64_t D = s.dim, G = s.group;
  const float c = s.scale * 1.4426950408889634f;  // scores to base-2 exponents
  at::parallel_for(0, s.kv_heads * s.blocks, 1, [&](int64_t begin, int64_t end) {
    amx::configure_tiles();
    // The operands of tile loads and stores 64-byte aligned: a tile row that straddles two
    // cache lines costs about twice the time.
    Aligned<BF16> q(G * kRows * D);
    // Per head of the group: accumulators, the last block's P.V, scores, probabilities.
    Aligned<float> o(G * kRows * D), pv(G * kRows * D), row_max(G * kRows), row_sum(G * kRows);
    Aligned<float> scores(G * kRows * kBlockKeys);
    Aligned<uint16_t> prob(G * kRows * kBlockKeys);
    const BF16* q_in = static_cast<const BF16*>(a.q);
    BF16* out = static_cast<BF16*>(a.out);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / s.blocks, u = task % s.blocks;
      const int64_t qb = (u % 2 == 0) ? u / 2 : s.blocks - 1 - u / 2;
      const int64_t i0 = qb * kRows, rows = std::min(kRows, s.tokens - i0);
      // The block's queries per head of the group, the rows past the end zero.
      std::fill(q.begin(), q.end(), BF16(0.0f));
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(static_cast<void*>(&q[(g * kRows + r) * D]),
                      q_in + (i0 + r) * a.q_token_stride + (h * G + g) * a.q_head_stride,
                      D * 2);
        }
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(pv.begin(), pv.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const BF16* kp = kpack + h * s.padded * D;
      const BF16* vp = vpack + h * s.padded * D;

      // The keys some row of the block sees, in packed indices, widened to 16-key tiles.
      const int64_t first_pos = s.prefix + i0, last_pos = first_pos + rows - 1;
      const int64_t lo = first_visible_key(first_pos, s.window, s.key_lo);
      const int64_t start = (lo - s.key_lo) / kKeyTile * kKeyTile;
      const int64_t stop = (last_pos + 1 - s.key_lo + kKeyTile - 1) / kKeyTile * kKeyTile;
      for (int64_t b0 = start; b0 < stop; b0 += kBlockKeys) {
        const int64_t n_tiles = std::min(kBlockKeys, stop - b0) / kKeyTile;
        const int64_t n = n_tiles * kKeyTile;
        const int64_t a0 = b0 + s.key_lo;  // position of the block's first key
        const bool masked =
            a0 + n - 1 > first_pos || (s.window > 0 && a0 <= last_pos - s.window);
        // Tiles, vectors, tiles: each head's scores are stored (and its probabilities
        // written) long before they are read, so no tile load waits on a store in flight.
        for (int64_t g = 0; g < G; ++g) {
          score_tiles(&q[g * kRows * D], D, kp, b0, n_tiles, &scores[g * kRows * kBlockKeys]);
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t r = 0; r < kRows; ++r) {
            int64_t vis0 = 0, vis1 = n;
            if (masked) {
              // Rows past the end act as the last row (their results are not stored).
              const int64_t pos = first_pos + std::min(r, rows - 1);
              vis1 = std::clamp<int64_t>(pos + 1 - a0, 0, n);
              vis0 = std::min(first_visible_key(pos, s.window, a0) - a0, n);
            }
            const int64_t row = g * kRows + r;
            softmax_row(&scores[row * kBlockKeys], &prob[row * kBlockKeys], n_tiles, vis0, vis1,
                        c, row_max[row], row_sum[row], &o[row * D], &pv[row * D], D);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          value_tiles(&prob[g * kRows * kBlockKeys], n_tiles, vp, s.padded, b0,
                      &pv[g * kRows * D], D);
        }
      }

      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          // Every row sees at least its own key, so the sum is positive; guard anyway.
          const float sum = row_sum[g * kRows + r];
          const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
          const float* acc = &o[(g * kRows + r) * D];
          const float* last = &pv[(g * kRows + r) * D];  // the last block's P.V
          BF16* dst = out + ((i0 + r) * s.heads + h * G + g) * D;
          for (int64_t d = 0; d < D; d += 16) {
            const __m512 x = _mm512_mul_ps(
                _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_loadu_ps(last + d)), inv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(x));
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace

bool prefill_attention_amx(const PrefillArgs& a) {
  if (!amx::amx_granted() || a.dtype != Dtype::bf16 || a.dim % kChunk != 0) return false;
  Shape s(a);
  s.padded = (s.keys + kKeyTile - 1) / kKeyTile * kKeyTile + kTileGroup;
  s.blocks = (s.tokens + kRows - 1) / kRows;
  const int64_t elements = s.kv_heads * s.padded * s.dim, tiles = s.padded / kKeyTile;
  // The packing writes every element (zeros past the keys): no zero-fill first.
  std::unique_ptr<BF16[]> kbuf(new BF16[elements]), vbuf(new BF16[elements]);
  BF16* kpack = kbuf.get();
  BF16* vpack = vbuf.get();
  at::parallel_for(0, s.kv_heads * tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / tiles, first = (t % tiles) * kKeyTile;
      pack_k_tile(a, s, h, first, kpack + h * s.padded * s.dim + first * s.dim);
      pack_v_tile(a, s, h, first, vpack + h * s.padded * s.dim);
    }
  });
  attend(a, s, kpack, vpack);
  return true;
}

#else  // no AMX in this copy

bool prefill_attention_amx(const PrefillArgs&) { return false; }

#endif

PLUGSERVE_ISA_END
