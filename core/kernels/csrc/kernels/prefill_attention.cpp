// Causal prefill attention for one sequence, optionally with a sliding window, on the CPU.
//
// q [E, H, D] holds the sequence's E new tokens, k and v [S, KVH, D] its whole K/V with the
// prefix first (S = prefix + E). Query i sits at position prefix + i and sees the keys at
// positions (prefix + i - window, prefix + i] (no lower bound without a window). Query head h
// uses kv head h / (H / KVH). The softmax is computed in float32; out has q's dtype.
//
// Flash-attention style: a task is one kv head and a block of consecutive query tokens,
// whose rows are (token, query head of the group) pairs, so the group's heads share every
// key and value they load. The task walks its visible keys in blocks of kBlockKeys with an
// online softmax (running max and sum per row, the output accumulator rescaled when the max
// grows). Key blocks outside every row's range (causality, window) are never touched, and
// only the blocks that cross some row's range are masked.
//
// K and V are packed once per call, for all tasks, in the layouts the inner loops want:
//  - K as panels of kPanel keys (one vector of float32 scores), transposed
//    ([panel][D][kPanel]): a panel's scores build up in one vector by FMAs of a broadcast
//    query value with a row of the panel, with no horizontal sums. In the avx512_bf16 copy,
//    with bf16 inputs, the panel holds pairs of dims ([panel][D/2][16][2]) for vdpbf16ps,
//    which multiplies 16 keys x 2 dims by a broadcast pair of query values.
//  - V as float32 rows ([key][D]): a broadcast probability times a V row accumulates into
//    the output row by FMAs. In the avx512_bf16 copy, with bf16 inputs, V is packed as pairs
//    of keys ([key / 2][D][2]) and the probabilities are rounded to bf16 for vdpbf16ps (the
//    accumulation, the sums and the softmax stay float32).
// Register tiles are kTileRows rows x kTileCols vectors (AVX-512: 6 x 4; AVX2 and the scalar
// copy: 6 x 2, to fit 16 registers), in prefill_attention_tiles.h with the vector softmax
// step, which runs in base 2, one FMA per vector of scores to their exponents.
//
// Paths: for D a multiple of the vector width, the vector path (float32 products; float16
// and bf16 inputs widened while packing), or the bf16 pair path in the avx512_bf16 copy.
// Otherwise (another D) a plain-loop version of the same algorithm.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "../vec/pvec.h"
#include "prefill_attention_tiles.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using namespace prefill;

// Block sizes, measured on a 2-core Zen 4 (E = 150 and 1024, 9 heads / 3 kv heads, D = 64):
// key blocks of 64 .. 512 and 24 .. 96 rows per task were all within 8% of each other.
// Larger key blocks spread a row's per-block softmax overhead (the max, the rescale) over
// more keys; fewer rows per task make more tasks, which balances short prompts better.
constexpr int64_t kBlockKeys = 256;   // keys per online-softmax step
constexpr int64_t kTargetRows = 24;   // query rows (tokens x group heads) per task, about
static_assert(kBlockKeys % kPanel == 0 && kBlockKeys % 16 == 0, "key blocks of whole panels");

// Where one call's keys and queries lie, and how they are cut into tasks.
struct Problem : PrefillShape {
  using PrefillShape::PrefillShape;
  int64_t padded = 0;        // keys rounded up to kPanel (the padding is zeros)
  int64_t block_tokens = 0;  // query tokens per task
  int64_t blocks = 0;        // query blocks per kv head
};

// 64-byte aligned scratch (a float32 K panel row is one AVX-512 vector).
template <typename T>
struct AlignedBuffer {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data;
  explicit AlignedBuffer(int64_t count) {
    const size_t bytes = (std::max<int64_t>(count, 1) * sizeof(T) + 63) / 64 * 64;
    data.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(data != nullptr, "prefill_attention: out of memory packing K/V");
  }
  T* get() const { return data.get(); }
};

// ---------------------------------------------------------------------------------------
// Packing, once per call, in parallel over (kv head, panel of keys); each function here
// packs one panel's keys of kv head h, keys [first, first + kPanel) counted from key_lo.
// Keys past the end are zeros: their scores are masked, and a zero probability times a
// garbage value could be NaN.

// Where key `key` (packed index) of kv head h lies in k or v, or nullptr past the end.
template <typename T>
inline const T* key_row(const T* base, int64_t tok_stride, int64_t head_stride,
                        const Problem& p, int64_t h, int64_t key) {
  return key < p.keys ? base + (p.key_lo + key) * tok_stride + h * head_stride : nullptr;
}

// K as a transposed float32 panel: dst[d][kPanel].
template <typename T>
void pack_k_panel_f32(const T* k, int64_t tok_stride, int64_t head_stride, const Problem& p,
                      int64_t h, int64_t first, float* dst) {
  for (int64_t l = 0; l < kPanel; ++l) {
    const T* src = key_row(k, tok_stride, head_stride, p, h, first + l);
    for (int64_t d = 0; d < p.dim; ++d) dst[d * kPanel + l] = src ? to_float(src[d]) : 0.f;
  }
}

// V as float32 rows: dst[key][d] for the panel's keys.
template <typename T>
void pack_v_panel_f32(const T* v, int64_t tok_stride, int64_t head_stride, const Problem& p,
                      int64_t h, int64_t first, float* dst) {
  for (int64_t l = 0; l < kPanel; ++l) {
    const T* src = key_row(v, tok_stride, head_stride, p, h, first + l);
    float* row = dst + l * p.dim;
    if (src == nullptr) {
      std::fill(row, row + p.dim, 0.f);
      continue;
    }
#pragma omp simd
    for (int64_t d = 0; d < p.dim; ++d) row[d] = to_float(src[d]);
  }
}

// ---------------------------------------------------------------------------------------
// The work on one key block. Each `...Kernels` type says how queries, K, V and the
// probabilities are stored (Q, K, V, P) and provides
//   pack_k, pack_v: one panel of keys of K and V (layouts above);
//   load_q:     one query row into the task's block, from q's dtype;
//   scores:     s[r][0 : kPanel * panels] = q_r . k_j (unscaled) for `rows` query rows;
//   softmax:    one row's online-softmax step (see softmax_plain);
//   accumulate: o[r][:] += sum_j p[r][j] * v_j over `keys` keys (a multiple of kPanel).

// One row's online-softmax step over a key block, in plain loops: s holds the row's raw
// scores for the block's `n` keys, of which [vis0, vis1) are visible to the row. Writes the
// probabilities exp(s * scale - m) to `prob` (zero outside the visible range), moves the
// running max m and sum l to include them, and rescales the row's accumulator o by
// exp(m_old - m_new) when the max grows.
inline void softmax_plain(const float* __restrict s, float* __restrict prob, int64_t n,
                          int64_t vis0, int64_t vis1, float scale, float& m, float& l,
                          float* __restrict o, int64_t D) {
  std::fill(prob, prob + n, 0.f);
  if (vis0 >= vis1) return;  // nothing visible here (a row near the diagonal or window edge)
  float block_max = kNegInf;
  for (int64_t j = vis0; j < vis1; ++j) block_max = std::max(block_max, s[j] * scale);
  const float m_new = std::max(m, block_max);
  // The first block a row sees has m = -inf, zero accumulators and sum: alpha is moot, and
  // exp(-inf) is not relied on to be 0 (exp_f32 clamps its argument).
  const float alpha = m == kNegInf ? 0.f : exp_f32(m - m_new);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = vis0; j < vis1; ++j) {
    const float e = exp_f32(s[j] * scale - m_new);
    prob[j] = e;
    sum += e;
  }
  if (alpha != 1.f) {
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
  }
  l = l * alpha + sum;
  m = m_new;
}

// Plain loops (any D; the compiler vectorises the panel and the D loops).
struct PlainKernels {
  using Q = float;
  using K = float;
  using V = float;
  using P = float;

  template <typename T>
  static void pack_k(const T* k, int64_t ts, int64_t hs, const Problem& p, int64_t h,
                     int64_t first, float* panel) {
    pack_k_panel_f32(k, ts, hs, p, h, first, panel);
  }
  template <typename T>
  static void pack_v(const T* v, int64_t ts, int64_t hs, const Problem& p, int64_t h,
                     int64_t first, float* rows) {
    pack_v_panel_f32(v, ts, hs, p, h, first, rows);
  }
  template <typename T>
  static void load_q(const T* src, float* dst, int64_t D) {
    for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
  }

  static void scores(const float* q, int64_t rows, int64_t D, const float* kp, int64_t panels,
                     float* s, int64_t s_stride) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t pn = 0; pn < panels; ++pn) {
        float acc[kPanel] = {};
        const float* panel = kp + pn * D * kPanel;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = q[r * D + d];
#pragma omp simd
          for (int64_t l = 0; l < kPanel; ++l) acc[l] += qd * panel[d * kPanel + l];
        }
        std::memcpy(s + r * s_stride + pn * kPanel, acc, sizeof(acc));
      }
    }
  }

  static void softmax(const float* s, float* prob, int64_t n, int64_t vis0, int64_t vis1,
                      float scale, float& m, float& l, float* o, int64_t D) {
    softmax_plain(s, prob, n, vis0, vis1, scale, m, l, o, D);
  }

  static void accumulate(const float* p, int64_t p_stride, int64_t rows, int64_t keys,
                         const float* v, int64_t D, float* o) {
    for (int64_t r = 0; r < rows; ++r) {
      float* __restrict orow = o + r * D;
      for (int64_t j = 0; j < keys; ++j) {
        const float pj = p[r * p_stride + j];
        const float* __restrict vrow = v + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) orow[d] += pj * vrow[d];
      }
    }
  }
};

// float32 products (float32 inputs, and float16 / bf16 widened to float32). D % kWidth == 0.
struct VecKernels : PlainKernels {
  static void scores(const float* q, int64_t rows, int64_t D, const float* kp, int64_t panels,
                     float* s, int64_t s_stride) {
    tiles<ScoresF32>(ScoreArgs<float>{q, D, kp, s, s_stride}, rows, panels);
  }

  static void softmax(const float* s, float* prob, int64_t n, int64_t vis0, int64_t vis1,
                      float scale, float& m, float& l, float* o, int64_t D) {
    softmax_vec(s, prob, n, vis0, vis1, scale, m, l, o, D);
  }

  static void accumulate(const float* p, int64_t p_stride, int64_t rows, int64_t keys,
                         const float* v, int64_t D, float* o) {
    tiles<ValuesF32>(ValueArgs<float>{p, p_stride, keys, v, D, o}, rows, D / kWidth);
  }
};

#if defined(__AVX512BF16__)
static_assert(kPanel == 16, "the bf16 pair layouts are 16 keys wide");

// bf16 K as a panel of dim pairs: dst[d / 2][16][2] (bf16 bits), moved a pair (32 bits) at a
// time.
void pack_k_panel_bf16(const BF16* k, int64_t tok_stride, int64_t head_stride,
                       const Problem& p, int64_t h, int64_t first, uint16_t* dst) {
  const uint32_t zero = 0;
  for (int64_t l = 0; l < kPanel; ++l) {
    const BF16* src = key_row(k, tok_stride, head_stride, p, h, first + l);
    for (int64_t dp = 0; dp < p.dim / 2; ++dp) {
      const void* pair = src ? static_cast<const void*>(src + 2 * dp) : &zero;
      std::memcpy(dst + (dp * kPanel + l) * 2, pair, sizeof(uint32_t));
    }
  }
}

// bf16 V as pairs of keys: dst[key / 2][d][2] (bf16 bits) for the panel's 16 keys.
void pack_v_panel_bf16(const BF16* v, int64_t tok_stride, int64_t head_stride,
                       const Problem& p, int64_t h, int64_t first, uint16_t* dst) {
  for (int64_t l = 0; l < kPanel; l += 2) {
    const BF16* even = key_row(v, tok_stride, head_stride, p, h, first + l);
    const BF16* odd = key_row(v, tok_stride, head_stride, p, h, first + l + 1);
    uint16_t* out = dst + l * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) {
      out[2 * d] = even ? even[d].x : uint16_t(0);
      out[2 * d + 1] = odd ? odd[d].x : uint16_t(0);
    }
  }
}

// bf16 inputs, D % 16 == 0: vdpbf16ps for both products.
struct Bf16Kernels {
  using Q = uint16_t;
  using K = uint16_t;
  using V = uint16_t;
  using P = uint16_t;

  static void pack_k(const BF16* k, int64_t ts, int64_t hs, const Problem& p, int64_t h,
                     int64_t first, uint16_t* panel) {
    pack_k_panel_bf16(k, ts, hs, p, h, first, panel);
  }
  static void pack_v(const BF16* v, int64_t ts, int64_t hs, const Problem& p, int64_t h,
                     int64_t first, uint16_t* rows) {
    pack_v_panel_bf16(v, ts, hs, p, h, first, rows);
  }
  static void load_q(const BF16* src, uint16_t* dst, int64_t D) {
    std::memcpy(dst, src, D * sizeof(uint16_t));
  }

  static void scores(const uint16_t* q, int64_t rows, int64_t D, const uint16_t* kp,
                     int64_t panels, float* s, int64_t s_stride) {
    tiles<ScoresBf16>(ScoreArgs<uint16_t>{q, D, kp, s, s_stride}, rows, panels);
  }

  static void softmax(const float* s, uint16_t* prob, int64_t n, int64_t vis0, int64_t vis1,
                      float scale, float& m, float& l, float* o, int64_t D) {
    softmax_vec(s, prob, n, vis0, vis1, scale, m, l, o, D);
  }

  static void accumulate(const uint16_t* p, int64_t p_stride, int64_t rows, int64_t keys,
                         const uint16_t* v, int64_t D, float* o) {
    tiles<ValuesBf16>(ValueArgs<uint16_t>{p, p_stride, keys, v, D, o}, rows, D / 16);
  }
};
#endif  // __AVX512BF16__

// ---------------------------------------------------------------------------------------
// The task loop, shared by all paths.

template <typename Kern, typename T>
void attend(const T* q, const typename Kern::K* kpack, const typename Kern::V* vpack,
            const Problem& p, T* out) {
  using Q = typename Kern::Q;
  using P = typename Kern::P;
  const int64_t D = p.dim, G = p.group, panels = p.padded / kPanel;
  const int64_t max_rows = p.block_tokens * G;
  // Later query blocks see more keys (the causal triangle): tasks are taken in the order
  // first, last, second, second-to-last, ... so that any run of consecutive tasks, as
  // at::parallel_for hands them to a thread, has about the same work as any other.
  at::parallel_for(0, p.kv_heads * p.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Q> qbuf(max_rows * D);
    std::vector<float> scores(max_rows * kBlockKeys), acc(max_rows * D);
    std::vector<P> prob(max_rows * kBlockKeys);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / p.blocks, u = task % p.blocks;
      const int64_t qb = (u % 2 == 0) ? u / 2 : p.blocks - 1 - u / 2;
      const int64_t i0 = qb * p.block_tokens, i1 = std::min(p.tokens, i0 + p.block_tokens);
      const int64_t rows = (i1 - i0) * G;
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          Kern::load_q(q + i * p.q_token_stride + (h * G + g) * p.q_head_stride,
                       qbuf.data() + ((i - i0) * G + g) * D, D);
        }
      }
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);

      // The keys some row of the block sees, in packed indices, widened to whole panels.
      const int64_t first_pos = p.prefix + i0, last_pos = p.prefix + i1 - 1;
      const int64_t lo = first_visible_key(first_pos, p.window, p.key_lo);
      const int64_t start = (lo - p.key_lo) / kPanel * kPanel;
      const int64_t stop = (last_pos + 1 - p.key_lo + kPanel - 1) / kPanel * kPanel;
      // Blocks are laid from `stop` down, so that the rows of the diagonal block compute at
      // most block_tokens + kPanel - 1 masked scores each, and a partial block, if any, is
      // the one farthest from the diagonal. (The order of the blocks does not matter
      // otherwise.)
      for (int64_t b1 = stop; b1 > start; b1 -= kBlockKeys) {
        const int64_t b0 = std::max(start, b1 - kBlockKeys), n = b1 - b0;
        Kern::scores(qbuf.data(), rows, D, kpack + (h * panels + b0 / kPanel) * D * kPanel,
                     n / kPanel, scores.data(), kBlockKeys);
        const int64_t a0 = b0 + p.key_lo, a1 = b1 + p.key_lo;  // key positions
        const bool masked = a1 - 1 > first_pos || (p.window > 0 && a0 <= last_pos - p.window);
        for (int64_t r = 0; r < rows; ++r) {
          int64_t vis0 = 0, vis1 = n;
          if (masked) {
            const int64_t pos = first_pos + r / G;
            vis1 = std::clamp<int64_t>(pos + 1 - a0, 0, n);
            vis0 = std::min(first_visible_key(pos, p.window, a0) - a0, n);
          }
          Kern::softmax(scores.data() + r * kBlockKeys, prob.data() + r * kBlockKeys, n, vis0,
                        vis1, p.scale, row_max[r], row_sum[r], acc.data() + r * D, D);
        }
        Kern::accumulate(prob.data(), kBlockKeys, rows, n, vpack + (h * p.padded + b0) * D, D,
                         acc.data());
      }

      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (i - i0) * G + g;
          // Every row sees at least its own key, so the sum is positive; guard anyway.
          const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
          const float* a = acc.data() + r * D;
          T* o = out + (i * p.heads + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(a[d] * inv);
        }
      }
    }
  });
}

// Packs K and V for `Kern`, both in one parallel pass, and runs the tasks.
template <typename Kern, typename T>
void run_with(const PrefillArgs& a, const Problem& p) {
  using K = typename Kern::K;
  using V = typename Kern::V;
  const int64_t elements = p.kv_heads * p.padded * p.dim, panels = p.padded / kPanel;
  AlignedBuffer<K> kbuf(elements);
  AlignedBuffer<V> vbuf(elements);
  K* kpack = kbuf.get();
  V* vpack = vbuf.get();
  const T* k_ptr = static_cast<const T*>(a.k);
  const T* v_ptr = static_cast<const T*>(a.v);
  at::parallel_for(0, p.kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / panels, first = (t % panels) * kPanel;
      Kern::pack_k(k_ptr, a.k_token_stride, a.k_head_stride, p, h, first,
                   kpack + t * kPanel * p.dim);
      Kern::pack_v(v_ptr, a.v_token_stride, a.v_head_stride, p, h, first,
                   vpack + t * kPanel * p.dim);
    }
  });
  attend<Kern>(static_cast<const T*>(a.q), kpack, vpack, p, static_cast<T*>(a.out));
}

template <typename T>
void run(const PrefillArgs& a, const Problem& p) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BF16>) {
    if (p.dim % 16 == 0) return run_with<Bf16Kernels, T>(a, p);
  }
#endif
  if (p.dim % kWidth == 0) return run_with<VecKernels, T>(a, p);
  run_with<PlainKernels, T>(a, p);
}

}  // namespace

void prefill_attention(const PrefillArgs& a) {
  Problem p(a);
  p.padded = (p.keys + kPanel - 1) / kPanel * kPanel;
  p.block_tokens = std::min(std::max<int64_t>(1, kTargetRows / p.group), p.tokens);
  p.blocks = (p.tokens + p.block_tokens - 1) / p.block_tokens;
  PLUGSERVE_FLOAT_TYPES(a.dtype, "prefill_attention", run<T>(a, p));
}

PLUGSERVE_ISA_END
