// The dense bf16 linear on AMX (Sapphire Rapids and later) for a decode batch's rows (and,
// in panels, a prefill's: panel_gemm below):
// out = x @ w.T (+ bias) in bf16, float32 sums in tile registers, against a weight packed
// once (plugserve.kernels.dense_amx) into the B-tile layout the tiles consume directly.
//
// At a decode batch's rows (9 .. ~100) the product is a stream over the weight: each weight
// byte is used by every row of x, but a layer's weights (7 MB at the default model) are read
// from memory every step. So the weight is laid out in the order it is read (strips of 32
// rows, each strip one contiguous run of 1 KiB tiles, amx_tiles.h), each thread takes a
// contiguous run of strips (one contiguous stream, which the hardware prefetcher follows),
// and while the tiles multiply one strip the next one is prefetched into L2 a slice per
// product step. x is the A operand straight from its rows (the last partial block of 32
// rows from a zero-padded, 64-byte aligned copy). Up to 32 rows this runs at the read
// bandwidth; each further 32-row block of x is another pass over the strip from L2, which
// does not hide behind the stream (core/kernels/README.md lists the orders and prefetches
// measured against it).
//
// Compiled with the AMX flags only into the avx512_bf16 copy, and only where the compiler
// takes them (plugserve.kernels.isa: PLUGSERVE_AMX); every other copy, and a CPU or OS
// without AMX, returns false and the caller keeps oneDNN's packed matmul.
#include <ATen/Parallel.h>

#include "../vec/pvec.h"
#include "amx_tiles.h"

PLUGSERVE_ISA_BEGIN

#if defined(PLUGSERVE_AMX)
namespace {

using namespace vec;
using amx::kStrip;
using amx::kTileElems;
using amx::kLine;
using amx::kTileK;

// How far ahead of the strip being multiplied its thread prefetches, in strips (one strip is
// 64 * K bytes: 36 KiB at K = 576, 96 KiB at K = 1536). Measured: 1, 2, 3 and 4 even; the
// prefetch gains 2-4% at 64-96 rows over the hardware prefetcher alone, nothing at fewer.
// Measured no faster (within +-5% at 32-96 rows): the prefetcht2 hint, plain loads in place
// of the prefetches, the whole next strip requested during the first block only; slower: all
// of it at once at the strip's start (+10%), only one line in 8 .. 64 of it (to start the
// hardware streamer per page: +50% at 64-96 rows), and the tiles' own lines requested into L1
// two steps ahead (+5-15% with aligned x; it only helped tile rows that straddle two lines).
constexpr int64_t kPrefetchStrips = 1;
// Rows up to which the weight is streamed strip by strip (all rows of x per strip); more go
// to panel_gemm (plugserve.kernels.dense_amx.MAX_ROWS is the same number).
constexpr int64_t kStreamRows = 96;

void dense_gemm(const DenseAmxArgs& a) {
  const amx::XTail x_tail = amx::x_tail(a);
  const BF16* w = static_cast<const BF16*>(a.w_packed);
  const int64_t strip_bytes = kStrip * a.K * 2, strip_lines = strip_bytes / kLine;
  const int64_t strips = (a.N + kStrip - 1) / kStrip;
  // The strip kPrefetchStrips on is requested into L2 a slice per product step (32-row block
  // of x and column tile), so the memory stays busy all through the strip's products, not
  // only while its first block of rows runs.
  const int64_t kbs = a.K / kTileK, steps = (a.M + 31) / 32 * kbs;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    amx::configure_tiles();
    const char* run = reinterpret_cast<const char*>(w);
    const char* run_end = run + end * strip_bytes;
    // The first strips of the run before their products need them.
    const int64_t lead = std::min(kPrefetchStrips, end - begin) * strip_bytes;
    for (int64_t off = 0; off < lead; off += kLine) prefetch_l2(run + begin * strip_bytes + off);
    for (int64_t s = begin; s < end; ++s) {
      const BF16* strip = w + s * (strip_bytes / 2);
      const char* next = run + (s + kPrefetchStrips) * strip_bytes;
      const int64_t n0 = s * kStrip, n_count = std::min(kStrip, a.N - n0);
      amx::multiply_strip<BF16>(a, strip, x_tail.data(), n0, n_count,
                                [&](int64_t block, int64_t kb) {
        if (next >= run_end) return;  // past this thread's run: the other thread reads it
        const int64_t step = block * kbs + kb;
        const int64_t from = step * strip_lines / steps, to = (step + 1) * strip_lines / steps;
        for (int64_t line = from; line < to; ++line) prefetch_l2(next + line * kLine);
      });
    }
    _tile_release();
  });
}

// Many rows (a prefill chunk): panels of x times every strip (amx::multiply_panels).
void panel_gemm(const DenseAmxArgs& a) {
  amx::multiply_panels<BF16>(a, static_cast<const BF16*>(a.w_packed),
                            amx::RowsInPlace<DenseAmxArgs>(a));
}

}  // namespace

bool dense_amx_linear(const DenseAmxArgs& a) {
  if (!amx::amx_granted() || a.K % kTileK != 0) return false;
  if (a.M > kStreamRows) {
    panel_gemm(a);
    return true;
  }
  dense_gemm(a);
  return true;
}

#else  // no AMX in this copy

bool dense_amx_linear(const DenseAmxArgs&) { return false; }

#endif

PLUGSERVE_ISA_END
