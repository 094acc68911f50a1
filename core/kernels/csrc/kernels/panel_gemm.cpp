// out [M, N] = x [M, K] @ w [N, K].T (+ bias) in float32 for a few dozen rows (a decode step
// of a batch): the weight streamed from memory once while the FMAs run.
//
// At 9..256 rows a float32 linear does 2 * M FLOPs per weight element read: too few for the
// weight stream to hide behind the arithmetic unless the two overlap, and oneDNN's packed
// matmul runs them one after the other (measured per decoder layer, 30 layers' weights
// cycled as in an engine step, 2 Xeon threads, avx512: 2,160 us at 64 rows against 1,390 us
// with the weights hot in cache). Here the weight is packed once into panels of kPanel
// output columns, [panels][K][kPanel] (benchmarks/panel_gemm_speed.py), and each thread
// takes a contiguous run of panels. A panel (kPanel x K floats, 108 KiB at K = 576) is
// multiplied by every row of x, kRows rows per register tile (kRows x kPanelVectors
// accumulators: x broadcast one element at a time, the panel's row of k loaded as vectors);
// its first tile reads it from memory and the others find it in L2. While the tiles of a
// panel run they fetch the next panel, one row of k per step of the k loop, spread over the
// tiles, so the next panel's stream overlaps this panel's arithmetic (with prefetcht2: at
// 64 rows 1,412-1,478 us per layer against 1,569-1,614 with prefetcht1 and 1,785 with
// prefetcht0; one panel ahead is as fast as two). Sums are float32 FMAs in k order; with
// the weights hot in cache the kernel runs at ~89% of oneDNN's float32 peak here (1,241 us
// at 64 rows).
//
// bf16 / fp16 weights on a CPU without native half dot products are packed in their own
// dtype and widened to float32 as each panel row is loaded (a 16-bit shift for bf16): half
// the bytes streamed, one widening per vector shared by the tile's rows.
#include <ATen/Parallel.h>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;

constexpr int kPanelVectors = 3;  // output columns per panel, in vectors
constexpr int64_t kPanel = kPanelVectors * kWidth;
// Rows of x per register tile: kRows x kPanelVectors accumulators + kPanelVectors panel
// vectors + 1 broadcast of x must fit the vector registers.
constexpr int kRows = kRegisters >= 32 ? 8 : 4;

// R rows of x times one panel over all of K, plus bias, into out (valid columns only).
// `next` (the following panel, or nullptr): rows k of it with k % tiles == tile are fetched
// into L2 during this tile, so the panel's tiles fetch all of it between them.
template <int R, typename TW>
inline void tile(const float* __restrict x, int64_t x_stride, const TW* __restrict panel,
                 int64_t K, const float* bias, int64_t n_valid, float* __restrict out,
                 int64_t out_stride, const TW* next, int64_t tile_index, int64_t tiles) {
  Reg acc[R][kPanelVectors];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVectors; ++j) acc[i][j] = F(0.0f);
  int64_t phase = tile_index;
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr && phase == 0) {
      const char* ahead = reinterpret_cast<const char*>(next + k * kPanel);
      for (int64_t b = 0; b < kPanel * int64_t(sizeof(TW)); b += 64) prefetch_far(ahead + b);
    }
    if (++phase == tiles) phase = 0;
    Reg w[kPanelVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVectors; ++j) w[j] = load(panel + k * kPanel + j * kWidth);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const F xv(x[i * x_stride + k]);
#pragma GCC unroll 4
      for (int j = 0; j < kPanelVectors; ++j) acc[i][j] = fmadd(xv, w[j], acc[i][j]);
    }
  }
  // Accumulators are read at constant indices only (see skinny_linear.cpp's `tile`).
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVectors; ++j) {
      const int64_t n = n_valid - j * kWidth;
      if (n <= 0) continue;
      F y(acc[i][j]);
      if (bias != nullptr) y = y + (n >= kWidth ? load(bias + j * kWidth)
                                                : load_n(bias + j * kWidth, n));
      if (n >= kWidth) {
        store(out + i * out_stride + j * kWidth, y);
      } else {
        store_n(out + i * out_stride + j * kWidth, y, n);
      }
    }
  }
}

template <int R, typename TW>
inline void tile_at(const PanelGemmArgs& a, int64_t m0, int64_t p, const TW* next,
                    int64_t tile_index, int64_t tiles) {
  const int64_t n0 = p * kPanel;
  tile<R>(a.x + m0 * a.x_stride, a.x_stride,
          static_cast<const TW*>(a.packed) + p * a.K * kPanel, a.K,
          a.bias == nullptr ? nullptr : a.bias + n0, std::min(kPanel, a.N - n0),
          a.out + m0 * a.N + n0, a.N, next, tile_index, tiles);
}

// The rows past the last full tile (fewer than kRows).
template <typename TW>
inline void tail_tile(const PanelGemmArgs& a, int64_t m0, int64_t p, const TW* next,
                      int64_t tile_index, int64_t tiles) {
  switch (a.M - m0) {
    case 7: if constexpr (kRows > 7) tile_at<7>(a, m0, p, next, tile_index, tiles); break;
    case 6: if constexpr (kRows > 6) tile_at<6>(a, m0, p, next, tile_index, tiles); break;
    case 5: if constexpr (kRows > 5) tile_at<5>(a, m0, p, next, tile_index, tiles); break;
    case 4: if constexpr (kRows > 4) tile_at<4>(a, m0, p, next, tile_index, tiles); break;
    case 3: tile_at<3>(a, m0, p, next, tile_index, tiles); break;
    case 2: tile_at<2>(a, m0, p, next, tile_index, tiles); break;
    case 1: tile_at<1>(a, m0, p, next, tile_index, tiles); break;
    default: break;
  }
}

template <typename TW>
void panel_gemm_typed(const PanelGemmArgs& a) {
  const TW* packed = static_cast<const TW*>(a.packed);
  const int64_t panels = (a.N + kPanel - 1) / kPanel;
  const int64_t tiles = (a.M + kRows - 1) / kRows;
  // A thread's panels are contiguous: one stream, each panel fetching the next.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const TW* next = p + 1 < end ? packed + (p + 1) * a.K * kPanel : nullptr;
      int64_t m0 = 0, t = 0;
      for (; m0 + kRows <= a.M; m0 += kRows, ++t) tile_at<kRows>(a, m0, p, next, t, tiles);
      tail_tile(a, m0, p, next, t, tiles);
    }
  });
}

}  // namespace

int64_t panel_gemm_width() { return kPanel; }

void panel_gemm(const PanelGemmArgs& a) {
  switch (a.w_dtype) {
    case Dtype::f32: panel_gemm_typed<float>(a); break;
    case Dtype::bf16: panel_gemm_typed<BF16>(a); break;
    case Dtype::f16: panel_gemm_typed<Half>(a); break;
    default: TORCH_CHECK(false, "panel_gemm: float32, bf16 or fp16 weights only");
  }
}

PLUGSERVE_ISA_END
