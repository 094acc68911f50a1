// What the AMX kernels share (quant_amx.cpp: quantized weights dequantized per strip;
// dense_amx.cpp: bf16 weights packed once): the run-time check, the tile configuration, a
// 16 x 16 transpose of 32-bit values (transpose16.h), and the product of all rows of x with
// one strip of 32 weight rows already in the VNNI-pair layout of B tiles.
//
// Only for sources compiled with the AMX opt-in (plugserve.kernels.isa: PLUGSERVE_AMX).
#pragma once

#if defined(PLUGSERVE_AMX)
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../vec/pvec.h"
#include "transpose16.h"

PLUGSERVE_ISA_BEGIN
namespace amx {

using vec::BF16;

constexpr int64_t kStrip = 32;       // weight rows per strip: two B tiles
constexpr int64_t kTileK = 32;       // bf16 columns of K per tile
constexpr int64_t kTileElems = 512;  // bf16 values in one 16 x 64-byte tile
constexpr int64_t kLine = 64;        // bytes per cache line

// The CPU has AMX-BF16 and the OS lets this process use the tile state (Linux:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once per process).
inline bool amx_granted() {
  static const bool granted = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 x 16 float32), 4-5: A (16 rows of 32 bf16), 6-7: B (16 VNNI rows).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

using tr::transpose16;

// A 64-byte aligned copy of rows of x: a tile row that straddles two cache lines costs a
// tile load about twice the time (std::vector's 16-byte alignment did that to every tail).
class XTail {
 public:
  const BF16* data() const { return rows_.get(); }
  BF16* reset(int64_t values) {
    rows_.reset(static_cast<BF16*>(std::aligned_alloc(64, (values * 2 + 63) / 64 * 64)));
    return rows_.get();
  }

 private:
  struct Free {
    void operator()(BF16* p) const { std::free(p); }
  };
  std::unique_ptr<BF16[], Free> rows_;
};

// The last partial block of 32 rows of x, zero-padded (tile loads read 16 or 32 rows); empty
// (data() null) where M is a multiple of 32. `Args` (here and below): x (bf16, rows x_stride
// apart), M, K, N, bias (float32 or nullptr), out ([M, N], contiguous).
template <typename Args>
XTail x_tail(const Args& a) {
  XTail tail;
  if (a.M % 32 != 0) {
    const int64_t m0 = a.M / 32 * 32;
    BF16* rows = tail.reset(32 * a.K);
    std::memset(static_cast<void*>(rows), 0, 32 * a.K * 2);
    const BF16* x = static_cast<const BF16*>(a.x);
    for (int64_t m = m0; m < a.M; ++m)
      std::memcpy(static_cast<void*>(rows + (m - m0) * a.K), x + m * a.x_stride, a.K * 2);
  }
  return tail;
}

// out rows m0 .. + m_count, columns n0 .. + n_count (+ bias) from c [32 rows][32 columns].
template <typename TO, typename Args>
void store_rows(const float* c, int64_t m0, int64_t m_count, int64_t n0, int64_t n_count,
                const Args& a) {
  TO* out = static_cast<TO*>(a.out);
  const __mmask16 lo = n_count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_count) - 1);
  const __mmask16 hi = n_count >= 32 ? __mmask16(0xFFFF)
                       : n_count <= 16 ? __mmask16(0)
                                       : __mmask16((1u << (n_count - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (a.bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(lo, a.bias + n0);
    b1 = _mm512_maskz_loadu_ps(hi, a.bias + n0 + 16);
  }
  for (int64_t m = 0; m < m_count; ++m) {
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + m * kStrip), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + m * kStrip + 16), b1);
    TO* dst = out + (m0 + m) * a.N + n0;
    if constexpr (std::is_same_v<TO, float>) {
      _mm512_mask_storeu_ps(dst, lo, v0);
      _mm512_mask_storeu_ps(dst + 16, hi, v1);
    } else {
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
      _mm512_mask_storeu_epi16(dst, (__mmask32(hi) << 16) | lo, both);
    }
  }
}

// All rows of x times one strip (n_count <= 32 valid weight rows at n0) in the B-tile layout:
// tile (kb, h) at strip + (2 kb + h) * kTileElems holds weight rows 16h .. + 16 and columns
// 32kb .. + 32 as 16 rows of 16 pairs (row p, pair i = w[16h + i][32kb + 2p .. + 2]).
// `during(block, kb)` runs before the products of each 32-row block of x and column tile (a
// prefetch of what comes next, spread over them, overlaps the products that way).
template <typename TO, typename Args, typename During>
void multiply_strip(const Args& a, const BF16* strip, const BF16* x_tail, int64_t n0,
                    int64_t n_count, During&& during) {
  const BF16* x = static_cast<const BF16*>(a.x);
  alignas(64) float c[kStrip * kStrip];
  const int64_t kbs = a.K / kTileK;
  for (int64_t m0 = 0; m0 < a.M; m0 += 32) {
    const int64_t m_count = std::min<int64_t>(32, a.M - m0);
    // Whole 32-row blocks straight from x; the last partial one from its zero-padded copy.
    const bool whole = m_count == 32;
    const int64_t block = m0 / 32;
    const BF16* xa = whole ? x + m0 * a.x_stride : x_tail;
    const int64_t stride = (whole ? a.x_stride : a.K) * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (m_count > 16) {
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kbs; ++kb) {
        during(block, kb);
        // Each load just before the first product that needs it.
        _tile_loadd(4, xa + kb * kTileK, stride);
        _tile_loadd(6, strip + (kb * 2) * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, strip + (kb * 2 + 1) * kTileElems, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xa + 16 * (stride / 2) + kb * kTileK, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, c + 16 * kStrip, kStrip * 4);
      _tile_stored(3, c + 16 * kStrip + 16, kStrip * 4);
    } else {
      for (int64_t kb = 0; kb < kbs; ++kb) {
        during(block, kb);
        _tile_loadd(4, xa + kb * kTileK, stride);
        _tile_loadd(6, strip + (kb * 2) * kTileElems, 64);
        _tile_loadd(7, strip + (kb * 2 + 1) * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, c, kStrip * 4);
    _tile_stored(1, c + 16, kStrip * 4);
    store_rows<TO>(c, m0, m_count, n0, n_count, a);
  }
}

// Many rows (a prefill chunk): the rows of x are cut into panels of at most kPanelRows, an
// equal number per thread, and each thread multiplies its panels by every strip of the
// weight in turn. A panel (256 x K bf16: 288 KiB at K = 576) stays in L2 while the strips
// pass, each strip is used by all of a panel's 32-row blocks from L1, and the next strip is
// requested into L2 a slice per product step. Every thread reads the whole weight: this is
// the faster order where the weight is small enough to stay in L2 between panels
// (plugserve.kernels.dense_amx.PANEL_MAX_WEIGHT_BYTES decides). w: the whole weight in the
// strips' B-tile layout (see multiply_strip).
constexpr int64_t kPanelRows = 256;

// The panel's rows of x as multiply_strip reads them: rows `stride` values apart, and the
// zero-padded copy of a last partial 32-row block (stride K; null where there is none).
struct PanelRows {
  const BF16* x;
  int64_t stride;
  const BF16* tail;
};

// a.x in bf16 as it is: rows of the panel read in place, the last block from x_tail's copy.
template <typename Args>
struct RowsInPlace {
  explicit RowsInPlace(const Args& a) : a_(a), tail_(x_tail(a)) {}
  PanelRows operator()(int64_t m0, int64_t /*rows*/) const {
    return {static_cast<const BF16*>(a_.x) + m0 * a_.x_stride, a_.x_stride, tail_.data()};
  }

 private:
  const Args& a_;
  XTail tail_;
};

// rows_of(m0, rows) gives each panel's rows of x (called on the thread that multiplies the
// panel, before its products).
template <typename TO, typename Args, typename RowsOf>
void multiply_panels(const Args& a, const BF16* w, const RowsOf& rows_of) {
  const int64_t strip_elems = kStrip * a.K, strip_lines = strip_elems * 2 / kLine;
  const int64_t strips = (a.N + kStrip - 1) / kStrip, kbs = a.K / kTileK;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // per_thread panels for each thread, of equal rows rounded up to whole 32-row blocks.
  const int64_t per_thread = (a.M + threads * kPanelRows - 1) / (threads * kPanelRows);
  const int64_t share = (a.M + threads * per_thread - 1) / (threads * per_thread);
  const int64_t panel_rows = (share + 31) / 32 * 32;
  const int64_t panels = (a.M + panel_rows - 1) / panel_rows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t p = begin; p < end; ++p) {
      // The panel as a linear of its own: its rows of x and of out. Only the last panel can
      // end in a partial block of 32 rows.
      Args panel = a;
      const int64_t m0 = p * panel_rows;
      panel.M = std::min(panel_rows, a.M - m0);
      const PanelRows rows = rows_of(m0, panel.M);
      panel.x = rows.x;
      panel.x_stride = rows.stride;
      panel.out = static_cast<TO*>(a.out) + m0 * a.N;
      const int64_t steps = (panel.M + 31) / 32 * kbs;
      for (int64_t s = 0; s < strips; ++s) {
        const BF16* strip = w + s * strip_elems;
        const char* next = reinterpret_cast<const char*>(strip + strip_elems);
        const bool last = s + 1 == strips;
        const int64_t n0 = s * kStrip, n_count = std::min(kStrip, a.N - n0);
        multiply_strip<TO>(panel, strip, rows.tail, n0, n_count, [&](int64_t block,
                                                                     int64_t kb) {
          if (last) return;  // the next strip is the next panel's first: already in L2
          const int64_t step = block * kbs + kb;
          const int64_t from = step * strip_lines / steps, to = (step + 1) * strip_lines / steps;
          for (int64_t line = from; line < to; ++line) vec::prefetch_l2(next + line * kLine);
        });
      }
    }
    _tile_release();
  });
}

}  // namespace amx
PLUGSERVE_ISA_END

#endif  // PLUGSERVE_AMX
