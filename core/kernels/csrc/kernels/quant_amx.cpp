// The many-row quantized linear on AMX (Sapphire Rapids and later): out = x @ dequantize(w).T
// with x in bf16, the weight blocks dequantized to bf16 and float32 sums in tile registers.
//
// Compiled with the AMX flags only into the avx512_bf16 copy, and only where the compiler
// takes them (plugserve.kernels.isa: PLUGSERVE_AMX); every other copy returns false and the
// op runs the dequantize-and-GEMM path. At run time the kernel also needs the CPU's AMX-BF16
// and the OS's leave to use the tile state (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), asked once per process); without them it returns false.
//
// Each task takes strips of 32 weight rows, dequantized to bf16 (64 * K bytes, kept in L1 /
// L2 while every row of x runs past them), 2 x 2 tiles at a time into 4 C tiles of 16 x 16
// float32 sums:
// - more than kRowsAsB rows of x: the strip goes a chunk (256 weights) of its rows at a time
//   into the VNNI-pair layout of B tiles (per 32 columns of K and 16 weight rows: 16 rows of
//   16 (k, k + 1) bf16 pairs, 1 KiB); A tiles are 16 rows x 32 columns straight from x; one
//   strip at a time, or the whole weight first and then panels of x against it
//   (gemm_strips, gemm_panels; past their limits the caller's oneDNN path runs);
// - up to kRowsAsB rows: the roles swap, so the weight, which few rows share, needs no
//   transpose: its row-major strip is the A operand, x (packed once per call) the B one,
//   and each C tile is transposed as it is stored.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../vec/pvec.h"
#include "amx_tiles.h"
#include "quant_blocks.h"
#include "quant_row_bf16.h"
#include "quant_widen.h"

#if defined(PLUGSERVE_AMX)
#include <cstdlib>
#include <vector>
#endif

PLUGSERVE_ISA_BEGIN

#if defined(PLUGSERVE_AMX)
namespace {

using namespace vec;
using quant::kBlock;
using quant::kChunk;

using amx::amx_granted;
using amx::configure_tiles;
using amx::kStrip;
using amx::kTileElems;
using amx::kTileK;
using amx::transpose16;

// Rows of x up to which x is the B operand and the weight the A one (few rows: the weight
// is then not transposed), past which the weight is packed into B tiles once per strip
// (measured: 16 rows 25-30% faster as B, 64 even, 128 and more slower).
constexpr int64_t kRowsAsB = 64;
// Rows up to which the strips are dequantized and multiplied one at a time (gemm_strips);
// past them, a weight of up to kPanelMaxWeightBytes in bf16 goes in panels (gemm_panels),
// and a larger one is left to the caller's dequantize-and-GEMM path (oneDNN's bf16 GEMM), as
// the dense bf16 linear leaves it to oneDNN (plugserve.kernels.dense_amx:
// PANEL_MAX_WEIGHT_BYTES). Measured at the default model's shapes (2 threads, weights in
// cache, int8 activations): 576 x 576 at 512 rows 0.24 ms in panels against 0.31 strip by
// strip and 0.29 through oneDNN; 3,072 x 576 (3.4 MiB in bf16) at 512 rows 1.16 / 1.08 /
// 0.96, at 2,048 rows 5.5 / 6.3 / 2.8; 960 x 576 at 2,048 rows 1.4 / 2.0 / 1.1-3.9 (oneDNN
// on an unpacked bf16 weight of that shape varies from call to call).
constexpr int64_t kStripRows = 256;
constexpr int64_t kPanelMaxWeightBytes = 2 << 20;

// Rows [m0, m0 + rows) of x in bf16 (rounded through int8 first for int8 activations) into
// out, `stride` values apart, and zero rows after them up to `padded` rows: the kernels take
// x as it comes (float32 or bf16) and convert each part where it is multiplied, so a
// prefill's rows pass through memory once instead of being written out whole and read back.
void x_rows_as_bf16(const QuantGemmArgs& a, int64_t m0, int64_t rows, BF16* out,
                    int64_t stride, int64_t padded) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (m0 + r) * a.x_stride;
    if (a.x_dtype == Dtype::f32) {
      quant::row_as(static_cast<const float*>(a.x) + at, a.K, a.int8, out + r * stride);
    } else {
      quant::row_as(static_cast<const BF16*>(a.x) + at, a.K, a.int8, out + r * stride);
    }
  }
  for (int64_t r = rows; r < padded; ++r)
    std::memset(static_cast<void*>(out + r * stride), 0, a.K * sizeof(BF16));
}

BF16* aligned_bf16(int64_t values) {
  return static_cast<BF16*>(std::aligned_alloc(64, (values * 2 + 63) / 64 * 64));
}

// Rows [n0, n0 + rows) of the weight (rows <= 32; the rest zero) into the strip's B tiles:
// tile (kb, h) holds weight rows n0 + 16h .. + 16 and columns 32kb .. + 32 as 16 rows of
// 16 pairs: row p, pair i = (w[16h + i][32kb + 2p], w[16h + i][32kb + 2p + 1]).
template <QuantFormat Fmt>
void pack_strip(const QuantGemmArgs& a, int64_t n0, int64_t rows, BF16* strip) {
  alignas(64) BF16 chunk[kStrip][kChunk];
  for (int64_t k0 = 0; k0 < a.K; k0 += kChunk) {
    const int64_t len = std::min(kChunk, a.K - k0);
    const int64_t span = len / quant::block_elems(Fmt) * quant::block_bytes(Fmt);
    const int64_t at = k0 / quant::block_elems(Fmt) * quant::block_bytes(Fmt);
    for (int64_t r = 0; r < kStrip; ++r) {
      if (r < rows) {
        const uint8_t* row = a.w + (n0 + r) * a.w_row_bytes;
        // The same bytes of the next strip's row, into L2 while this strip is multiplied
        // (32 rows read a chunk at a time are too many streams for the hardware prefetcher).
        if (n0 + kStrip + r < a.N) {
          for (int64_t off = 0; off < span; off += 64)
            prefetch_l2(row + kStrip * a.w_row_bytes + at + off);
        }
        quant::widen_span<Fmt, BF16>(row, k0, len, chunk[r]);
      } else {
        std::memset(static_cast<void*>(chunk[r]), 0, sizeof(chunk[r]));
      }
    }
    // A 16 x 16 transpose of 32-bit pairs per tile: row i of the chunk's 32 columns is 16
    // pairs; tile row p takes pair p of every row.
    for (int64_t kb = 0; kb < len / kTileK; ++kb) {
      for (int64_t h = 0; h < 2; ++h) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_load_si512(chunk[16 * h + i] + kb * kTileK);
        transpose16(r);
        // r[p] now holds pair p of rows 0..15.
        BF16* tile = strip + ((k0 / kTileK + kb) * 2 + h) * kTileElems;
        for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 32, r[p]);
      }
    }
  }
}

// kRowsAsB .. kStripRows rows: strip by strip, each strip dequantized once and multiplied
// by all rows of x (each thread a run of strips: the weight is read once, and x, a few
// hundred KiB, stays in L2).
template <QuantFormat Fmt, typename TO>
void gemm_strips(const QuantGemmArgs& args) {
  // x (a few hundred rows) in bf16 once, zero-padded to whole 32-row blocks, every strip's
  // products read it from there (the last partial block in place: no tail copy).
  QuantGemmArgs a = args;
  const int64_t padded = (a.M + 31) / 32 * 32;
  BF16* xb = aligned_bf16(padded * a.K);
  at::parallel_for(0, a.M, 16, [&](int64_t begin, int64_t end) {
    x_rows_as_bf16(args, begin, end - begin, xb + begin * a.K, a.K, end - begin);
  });
  std::memset(static_cast<void*>(xb + a.M * a.K), 0, (padded - a.M) * a.K * sizeof(BF16));
  a.x = xb;
  a.x_stride = a.K;
  const BF16* x_tail = a.M % 32 != 0 ? xb + a.M / 32 * 32 * a.K : nullptr;
  const int64_t strips = (a.N + kStrip - 1) / kStrip;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    BF16* strip = static_cast<BF16*>(std::aligned_alloc(64, kStrip * a.K * 2));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * kStrip, n_count = std::min(kStrip, a.N - n0);
      pack_strip<Fmt>(a, n0, n_count, strip);
      amx::multiply_strip<TO>(a, strip, x_tail, n0, n_count, [](int64_t, int64_t) {});
    }
    std::free(strip);
    _tile_release();
  });
  std::free(xb);
}

// More rows (a prefill chunk) and a small weight: the whole weight dequantized into the
// strips' B-tile layout once (each thread a run of strips), then panels of x times every
// strip (amx::multiply_panels, the dense kernel's prefill order: a panel of x stays in L2
// while the strips pass, where x itself would be read from L3 once per strip).
template <QuantFormat Fmt, typename TO>
void gemm_panels(const QuantGemmArgs& a) {
  const int64_t strips = (a.N + kStrip - 1) / kStrip;
  BF16* packed = static_cast<BF16*>(std::aligned_alloc(64, strips * kStrip * a.K * 2));
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * kStrip;
      pack_strip<Fmt>(a, n0, std::min(kStrip, a.N - n0), packed + s * kStrip * a.K);
    }
  });
  // Each panel's rows of x converted by the thread that multiplies it, into its own buffer
  // (at most kPanelRows rows, zero-padded to whole 32-row blocks), kept in L2 for the panel.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<BF16*> buffers(threads, nullptr);
  amx::multiply_panels<TO>(a, packed, [&](int64_t m0, int64_t rows) {
    BF16*& buffer = buffers[at::get_thread_num()];
    if (buffer == nullptr) buffer = aligned_bf16(amx::kPanelRows * a.K);
    const int64_t padded = (rows + 31) / 32 * 32;
    x_rows_as_bf16(a, m0, rows, buffer, a.K, padded);
    const BF16* tail = rows % 32 != 0 ? buffer + rows / 32 * 32 * a.K : nullptr;
    return amx::PanelRows{buffer, a.K, tail};
  });
  for (BF16* buffer : buffers) std::free(buffer);
  std::free(packed);
}

// ---- few rows of x (M <= kRowsAsB): the weight as the A operand -------------------------
// Row-major weight rows load straight into A tiles (no transpose of the weight: the cost
// that dominates when few rows share it); x, packed once per call into the VNNI layout of
// B tiles, is the B operand; each C tile (16 weight rows x 16 rows of x) is transposed as
// it is stored.

// x rows [16j, 16j + 16) (zero past M), columns 32kb .. + 32 at xp + (j * kbs + kb) * 512.
// Each 16 rows are converted to bf16 first (x_rows_as_bf16, zero past M), then transposed.
void pack_x(const QuantGemmArgs& a, BF16* xp) {
  const int64_t kbs = a.K / kTileK;
  at::parallel_for(0, (a.M + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    BF16* rows = aligned_bf16(16 * a.K);
    for (int64_t j = begin; j < end; ++j) {
      x_rows_as_bf16(a, 16 * j, std::min<int64_t>(16, a.M - 16 * j), rows, a.K, 16);
      for (int64_t kb = 0; kb < kbs; ++kb) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * a.K + kb * kTileK);
        transpose16(r);
        BF16* tile = xp + (j * kbs + kb) * kTileElems;
        for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 32, r[p]);
      }
    }
    std::free(rows);
  });
}

// out rows m0 .. + m_count, columns n0 .. + n_count from c [32 weight rows][32 rows of x].
template <typename TO>
void store_transposed(const float* c, int64_t m0, int64_t m_count, int64_t n0,
                      int64_t n_count, const QuantGemmArgs& a) {
  TO* out = static_cast<TO*>(a.out);
  for (int64_t h = 0; h < 2 && 16 * h < n_count; ++h) {
    const int64_t nh = std::min<int64_t>(16, n_count - 16 * h);
    const __mmask16 mask = nh >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nh) - 1);
    const __m512 bias = a.bias != nullptr ? _mm512_maskz_loadu_ps(mask, a.bias + n0 + 16 * h)
                                          : _mm512_setzero_ps();
    for (int64_t g = 0; g < 2 && 16 * g < m_count; ++g) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_load_si512(c + (16 * h + i) * kStrip + 16 * g);
      transpose16(r);  // r[j]: row 16g + j of x against the 16 weight rows
      for (int64_t j = 0; j < std::min<int64_t>(16, m_count - 16 * g); ++j) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[j]), bias);
        TO* dst = out + (m0 + 16 * g + j) * a.N + n0 + 16 * h;
        if constexpr (std::is_same_v<TO, float>) {
          _mm512_mask_storeu_ps(dst, mask, v);
        } else {
          _mm256_mask_storeu_epi16(dst, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
      }
    }
  }
}

template <QuantFormat Fmt, typename TO>
void gemm_rows_as_b(const QuantGemmArgs& a) {
  const int64_t kbs = a.K / kTileK, mblocks = (a.M + 15) / 16;
  BF16* xp = static_cast<BF16*>(std::aligned_alloc(64, mblocks * kbs * kTileElems * 2));
  pack_x(a, xp);
  const int64_t strips = (a.N + kStrip - 1) / kStrip;
  // Each thread widens the next strip's rows a few per product step, into the other of two
  // buffers, so that the vector work of the widening runs while the tile unit multiplies
  // (widening all of a strip, then multiplying it, left each unit idle while the other ran).
  const int64_t steps = (mblocks + 1) / 2 * kbs, rows_per_step = (kStrip + steps - 1) / steps;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    BF16* buffers[2] = {static_cast<BF16*>(std::aligned_alloc(64, kStrip * a.K * 2)),
                        static_cast<BF16*>(std::aligned_alloc(64, kStrip * a.K * 2))};
    alignas(64) float c[kStrip * kStrip];
    const int64_t stride = a.K * 2;
    // Rows [r0, r1) of strip s into w (zero past the matrix), each row's bytes of the strip
    // after it (if this thread takes it) asked into L2 (see pack_strip).
    const auto widen_rows = [&](int64_t s, BF16* w, int64_t r0, int64_t r1) {
      const int64_t n0 = s * kStrip, n_count = std::min(kStrip, a.N - n0);
      for (int64_t r = r0; r < std::min(r1, kStrip); ++r) {
        if (r < n_count) {
          const uint8_t* row = a.w + (n0 + r) * a.w_row_bytes;
          if (s + 1 < end) {
            for (int64_t off = 0; off < a.w_row_bytes; off += 64)
              prefetch_l2(row + kStrip * a.w_row_bytes + off);
          }
          quant::widen_row<Fmt, BF16>(row, a.K, w + r * a.K);
        } else {
          std::memset(static_cast<void*>(w + r * a.K), 0, a.K * 2);
        }
      }
    };
    widen_rows(begin, buffers[0], 0, kStrip);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * kStrip, n_count = std::min(kStrip, a.N - n0);
      const BF16* w = buffers[(s - begin) & 1];
      BF16* next = s + 1 < end ? buffers[(s - begin + 1) & 1] : nullptr;
      int64_t next_row = 0;
      const auto widen_some = [&] {
        if (next != nullptr && next_row < kStrip) {
          widen_rows(s + 1, next, next_row, next_row + rows_per_step);
          next_row += rows_per_step;
        }
      };
      for (int64_t j = 0; j < mblocks; j += 2) {
        const BF16* b0 = xp + j * kbs * kTileElems;
        _tile_zero(0);
        _tile_zero(2);
        if (j + 1 < mblocks) {
          const BF16* b1 = b0 + kbs * kTileElems;
          _tile_zero(1);
          _tile_zero(3);
          for (int64_t kb = 0; kb < kbs; ++kb) {
            _tile_loadd(4, w + kb * kTileK, stride);
            _tile_loadd(6, b0 + kb * kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + kb * kTileElems, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, w + 16 * a.K + kb * kTileK, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            widen_some();
          }
          _tile_stored(1, c + 16, kStrip * 4);
          _tile_stored(3, c + 16 * kStrip + 16, kStrip * 4);
        } else {
          for (int64_t kb = 0; kb < kbs; ++kb) {
            _tile_loadd(4, w + kb * kTileK, stride);
            _tile_loadd(6, b0 + kb * kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, w + 16 * a.K + kb * kTileK, stride);
            _tile_dpbf16ps(2, 5, 6);
            widen_some();
          }
        }
        _tile_stored(0, c, kStrip * 4);
        _tile_stored(2, c + 16 * kStrip, kStrip * 4);
        store_transposed<TO>(c, 16 * j, std::min<int64_t>(32, a.M - 16 * j), n0, n_count, a);
      }
      if (next != nullptr) widen_rows(s + 1, next, next_row, kStrip);  // any rows left
    }
    std::free(buffers[0]);
    std::free(buffers[1]);
    _tile_release();
  });
  std::free(xp);
}

}  // namespace

bool amx_usable() { return amx_granted(); }

bool quant_gemm_amx(const QuantGemmArgs& a) {
  if (!amx_granted() || a.K % kTileK != 0) return false;
  if (a.M > kStripRows && a.N * a.K * 2 > kPanelMaxWeightBytes) return false;
  quant::with_format(a.format, [&](auto fmt) {
    constexpr QuantFormat Fmt = decltype(fmt)::value;
    TORCH_CHECK(a.out_dtype == Dtype::f32 || a.out_dtype == Dtype::bf16,
                "quant_gemm: float32 or bfloat16 output only");
    const bool f32 = a.out_dtype == Dtype::f32;
    if (a.M <= kRowsAsB) {
      f32 ? gemm_rows_as_b<Fmt, float>(a) : gemm_rows_as_b<Fmt, BF16>(a);
    } else if (a.M <= kStripRows) {
      f32 ? gemm_strips<Fmt, float>(a) : gemm_strips<Fmt, BF16>(a);
    } else {
      f32 ? gemm_panels<Fmt, float>(a) : gemm_panels<Fmt, BF16>(a);
    }
  });
  return true;
}

#else  // no AMX in this copy

bool amx_usable() { return false; }
bool quant_gemm_amx(const QuantGemmArgs&) { return false; }

#endif

PLUGSERVE_ISA_END
