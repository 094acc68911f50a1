// Decode attention straight from the paged KV cache, and the KV store before it.
//
// One query token per row q[i] ([heads, head_dim]) attends to the keys at
// slots[i, first_key[i] : kv_lens[i]] of the cache buffers k/v ([slots, kv_heads, head_dim]).
// Nothing is gathered: each (row, kv head) task reads its keys and values where they lie,
// once, widening bf16 / fp16 / fp8 to float32 on the fly, and computes the softmax in float32
// for the query heads that share that kv head (grouped-query attention). The output has q's
// dtype.
//
// For head_dim 64, 128 and 256 the passes are vector code: one key's row is loaded into
// registers once and dotted with every query head of its group; the value pass keeps a block
// of heads x 4 vectors of accumulators in registers and streams the values once per block.
// Other head_dims run plain loops the compiler vectorises.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <vector>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using E4M3 = c10::Float8_e4m3fn;
using E5M2 = c10::Float8_e5m2;

// Keys (and values) prefetched this many positions ahead: they lie at scattered pages. The
// score pass asks for keys and values 24 ahead into L2, the value pass for values 16 ahead
// into L1. Measured at 64 rows x 250 keys x 30 layers, bf16, 2 Zen 4 threads: 21.0 ms with
// keys 16 ahead into L1 and values into L2, 17.5 ms like this (fp32: 33.7 -> 30.6 ms).
constexpr int64_t kScorePrefetchKeys = 24;
constexpr int64_t kPrefetchKeys = 16;
constexpr int64_t kPrefetchStride = 64;
// Query heads per block of the value pass: GB x 4 accumulators + 4 values + 1 must fit.
constexpr int kHeadBlock = kRegisters >= 32 ? 4 : 2;
// A task costs its keys plus this many (loading q, storing the output) when the work is
// cut into one piece per thread; no piece is smaller than kMinPiece.
constexpr int64_t kTaskCost = 8;
constexpr int64_t kMinPiece = 256;

// One cache element as float32 (fp8 values times the buffer's scale).
template <typename T>
inline float cache_value(T v, float scale) {
  if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
    return static_cast<float>(v) * scale;
  } else {
    return to_float(v);
  }
}

// kWidth cache values as float32.
template <typename T>
inline F load_cache(const T* p, float scale) {
  if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
    __at_align__ float tmp[kWidth];
    for (int64_t i = 0; i < kWidth; ++i) tmp[i] = static_cast<float>(p[i]);
    return F::loadu(tmp) * F(scale);
  } else {
    return load(p);
  }
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = cache_value(src[d], scale);
}

constexpr int64_t kBlock = 16;  // keys whose dots are summed across lanes together
static_assert(kBlock % kWidth == 0);

// scores[j] = scale * (the sum of the lanes of dots[j * kWidth ...]) for j < n <= kBlock;
// returns the largest of them. The AVX-512 copies sum the 16 vectors in one transposing tree
// (45 instructions) instead of one horizontal sum (8) per key.
inline float sum_lanes(const float* dots, int64_t n, float scale, float* scores) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kWidth == kBlock);
  __m512 t[8], w[4];
  for (int k = 0; k < 8; ++k) {  // key pairs: per quarter, (0, 2) from the first, (1, 3) second
    const __m512 x = _mm512_loadu_ps(dots + 2 * k * kWidth);
    const __m512 y = _mm512_loadu_ps(dots + (2 * k + 1) * kWidth);
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int k = 0; k < 4; ++k)  // per quarter: keys 4k .. 4k + 3, each summed over the quarter
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                                  _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                                  _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88),
                                   _mm512_shuffle_f32x4(z0, z1, 0xDD));
  const __m512 out = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  _mm512_mask_storeu_ps(scores, valid, out);
  return _mm512_mask_reduce_max_ps(valid, out);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = hsum(F::loadu(dots + j * kWidth)) * scale;
    mx = std::max(mx, scores[j]);
  }
  return mx;
#endif
}

// Scores of the n keys of a task for its group of query heads (scores[g * n + j]) and their
// maxima. Each key's row is loaded once and dotted with every query head: with kBf16 (bf16
// keys under bf16 queries, in the AVX-512 BF16 copy) as bf16 pairs with vdpbf16ps (exact
// products, float32 sums), otherwise widened to float32. The dots of kBlock keys are summed
// across lanes together.
template <typename TK, int64_t D, bool kBf16>
void scores_vec(const float* qf, const BF16* qb, int64_t group, const TK* base,
                const int64_t* row_slots, int64_t n, int64_t token_stride, float scale,
                float k_scale, float* scores, float* row_max, const TK* v_base,
                int64_t v_token_stride, float* dots) {
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t jj = 0; jj < nb; ++jj) {
      const int64_t j = j0 + jj;
      if (j + kScorePrefetchKeys < n) {
        // This key and its values, into L2 (the values for the value pass: a task's values
        // fit there). Asking for both keeps more lines in flight than fetching keys into L1,
        // which this pass, waiting on scattered keys, is limited by.
        const int64_t slot = row_slots[j + kScorePrefetchKeys];
        const char* k_ahead = reinterpret_cast<const char*>(base + slot * token_stride);
        const char* v_ahead = reinterpret_cast<const char*>(v_base + slot * v_token_stride);
        for (int64_t b = 0; b < D * int64_t(sizeof(TK)); b += kPrefetchStride) {
          prefetch_l2(k_ahead + b);
          prefetch_l2(v_ahead + b);
        }
      }
      const TK* kp = base + row_slots[j] * token_stride;
#if defined(__AVX512BF16__)
      if constexpr (kBf16) {
        constexpr int CB = D / 32;
        __m512i kc[CB];
#pragma GCC unroll 8
        for (int c = 0; c < CB; ++c) kc[c] = _mm512_loadu_si512(kp + 32 * c);
        for (int64_t g = 0; g < group; ++g) {
          const BF16* qg = qb + g * D;
          __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) {
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                   (__m512bh)kc[c]);
          }
          _mm512_storeu_ps(dots + (g * kBlock + jj) * kWidth, acc);
        }
        continue;
      }
#endif
      constexpr int C = D / kWidth;
      Reg kc[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) kc[c] = load_cache(kp + kWidth * c, k_scale);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * D;
        F acc = F(kc[0]) * F::loadu(qg);
#pragma GCC unroll 16
        for (int c = 1; c < C; ++c) acc = fmadd(kc[c], F::loadu(qg + kWidth * c), acc);
        acc.store(dots + (g * kBlock + jj) * kWidth);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float mx = sum_lanes(dots + g * kBlock * kWidth, nb, scale, scores + g * n + j0);
      row_max[g] = std::max(row_max[g], mx);
    }
  }
  (void)qb;
}

// acc[g0 + g][d0 : d0 + 4 kWidth] = sum_j probs[g0 + g][j] * v_j[d0 : ...] for g < GB.
template <typename TK, int GB>
void values_block(const float* probs, int64_t n, int64_t g0, const TK* base,
                  const int64_t* row_slots, int64_t token_stride, float v_scale, int64_t d0,
                  int64_t D, float* acc) {
  Reg a[GB][4];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[g][c] = F(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchKeys < n) {
      const char* ahead = reinterpret_cast<const char*>(
          base + row_slots[j + kPrefetchKeys] * token_stride + d0);
      for (int64_t b = 0; b < 4 * kWidth * int64_t(sizeof(TK)); b += 64) prefetch_l1(ahead + b);
    }
    const TK* vp = base + row_slots[j] * token_stride + d0;
    const Reg v[4] = {load_cache(vp, v_scale), load_cache(vp + kWidth, v_scale),
                      load_cache(vp + 2 * kWidth, v_scale),
                      load_cache(vp + 3 * kWidth, v_scale)};
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      const F pg(probs[(g0 + g) * n + j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[g][c] = fmadd(v[c], pg, a[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) F(a[g][c]).store(acc + (g0 + g) * D + d0 + kWidth * c);
}

template <typename TK, int64_t D>
void values_vec(const float* probs, int64_t n, int64_t group, const TK* base,
                const int64_t* row_slots, int64_t token_stride, float v_scale, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 4 * kWidth) {
    int64_t g0 = 0;
    for (; g0 + kHeadBlock <= group; g0 += kHeadBlock)
      values_block<TK, kHeadBlock>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D,
                                   acc);
    switch (group - g0) {
      case 3:
        if constexpr (kHeadBlock > 3)
          values_block<TK, 3>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      case 2:
        if constexpr (kHeadBlock > 2)
          values_block<TK, 2>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      case 1:
        values_block<TK, 1>(probs, n, g0, base, row_slots, token_stride, v_scale, d0, D, acc);
        break;
      default: break;
    }
  }
}

// q rows of the queries' dtype as float32, and float32 results stored in it (a runtime
// switch: the kernel itself is compiled once per cache type and head_dim, not per q type).
inline void load_query(const PagedDecodeArgs& a, int64_t offset, float* dst, int64_t n) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "paged_decode", {
    const T* src = static_cast<const T*>(a.q) + offset;
    for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
  });
}

inline void store_output(const PagedDecodeArgs& a, int64_t offset, const float* src, float inv,
                         int64_t n) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "paged_decode", {
    T* dst = static_cast<T*>(a.out) + offset;
    for (int64_t d = 0; d < n; ++d) dst[d] = from_float<T>(src[d] * inv);
  });
}

// One thread's buffers.
struct Scratch {
  std::vector<float> qf, kv_row, scores, dots;
  std::vector<BF16> qb;
  Scratch(int64_t group, int64_t dim)
      : qf(group * dim), kv_row(dim), dots(group * kBlock * kWidth, 0.f), qb(group * dim) {}
};

// The softmax state of one task's query heads over some of its keys: running max, sum of
// e^(score - max), and the output not yet divided by that sum ([group, dim]).
struct State {
  float* m;
  float* l;
  float* acc;
};

// Keys [j0, j1) (counted from first_key) of row i for the query heads of kv head h.
template <typename TK, int64_t kDim, bool kBf16>
void attend(const PagedDecodeArgs& a, int64_t i, int64_t h, int64_t j0, int64_t j1,
            Scratch& w, const State& st) {
  const int64_t heads = a.heads, group = heads / a.kv_heads;
  const int64_t dim = kDim > 0 ? kDim : a.dim;  // a constant lets the compiler unroll
  const int64_t n = j1 - j0;
  const int64_t start = std::max<int64_t>(a.first_key[i], 0) + j0;
  const int64_t* row_slots = a.slots + i * a.slot_stride + start;
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(row_slots[j] >= 0 && row_slots[j] < a.num_slots, "paged_decode: slot ",
                row_slots[j], " of query ", i, " is outside the cache [0, ", a.num_slots, ")");
  }
  load_query(a, (i * heads + h * group) * dim, w.qf.data(), group * dim);
  if constexpr (kBf16) {
    std::copy_n(static_cast<const BF16*>(a.q) + (i * heads + h * group) * dim, group * dim,
                w.qb.data());
  }
  w.scores.resize(group * n);  // every entry is written below
  float* scores = w.scores.data();
  std::fill_n(st.m, group, -std::numeric_limits<float>::infinity());
  const TK* k_base = static_cast<const TK*>(a.k) + h * a.k_head_stride;
  const TK* v_base = static_cast<const TK*>(a.v) + h * a.v_head_stride;
  constexpr bool kVector = kDim > 0 && kDim % (4 * kWidth) == 0;
  if constexpr (kVector) {
    scores_vec<TK, kDim, kBf16>(w.qf.data(), w.qb.data(), group, k_base, row_slots, n,
                                a.k_token_stride, a.scale, a.k_scale, scores, st.m, v_base,
                                a.v_token_stride, w.dots.data());
  } else {
    for (int64_t j = 0; j < n; ++j) {
      load_row(k_base + row_slots[j] * a.k_token_stride, w.kv_row.data(), dim, a.k_scale);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = w.qf.data() + g * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * w.kv_row[d];
        const float score = dot * a.scale;
        scores[g * n + j] = score;
        st.m[g] = std::max(st.m[g], score);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict s = scores + g * n;
    const float m = st.m[g];
    int64_t j = 0;
    F vsum(0.0f);
    for (; j + kWidth <= n; j += kWidth) {
      const F e = vec::exp(F::loadu(s + j) - F(m));
      e.store(s + j);
      vsum = vsum + e;
    }
    float sum = hsum(vsum);
    for (; j < n; ++j) {
      s[j] = exp_f32(s[j] - m);
      sum += s[j];
    }
    st.l[g] = sum;
  }
  if constexpr (kVector) {
    values_vec<TK, kDim>(scores, n, group, v_base, row_slots, a.v_token_stride, a.v_scale,
                         st.acc);
  } else {
    std::fill_n(st.acc, group * dim, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      load_row(v_base + row_slots[j] * a.v_token_stride, w.kv_row.data(), dim, a.v_scale);
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict o = st.acc + g * dim;
        const float p = scores[g * n + j];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] += p * w.kv_row[d];
      }
    }
  }
}

// Task t's output: the states of its pieces (one when it was not cut) merged and divided
// by their sum. A task with no keys (l == 0) gets zeros, as a fully masked softmax does not.
void finish(const PagedDecodeArgs& a, int64_t t, const State* states, int64_t count,
            float* acc) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim;
  const int64_t i = t / a.kv_heads, h = t % a.kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t offset = (i * a.heads + h * group + g) * dim;
    if (count == 1) {
      const float l = states[0].l[g];
      store_output(a, offset, states[0].acc + g * dim, l > 0.f ? 1.f / l : 0.f, dim);
      continue;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < count; ++r) m = std::max(m, states[r].m[g]);
    float l = 0.f;
    std::fill_n(acc, dim, 0.f);
    for (int64_t r = 0; r < count; ++r) {
      const float f = exp_f32(states[r].m[g] - m);
      l += states[r].l[g] * f;
      const float* src = states[r].acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += src[d] * f;
    }
    store_output(a, offset, acc, l > 0.f ? 1.f / l : 0.f, dim);
  }
}

template <typename TK, int64_t kDim, bool kBf16>
void decode(const PagedDecodeArgs& a) {
  const int64_t kv_heads = a.kv_heads, group = a.heads / kv_heads, dim = a.dim;
  const int64_t tasks = a.rows * kv_heads;
  // Task t = (row t / kv_heads, kv head t % kv_heads) covers [cost[t], cost[t + 1]) of the
  // tasks' keys laid end to end (plus kTaskCost each).
  std::vector<int64_t> cost(tasks + 1, 0), keys(a.rows);
  for (int64_t i = 0; i < a.rows; ++i) {
    const int64_t start = std::max<int64_t>(a.first_key[i], 0), stop = a.kv_lens[i];
    TORCH_CHECK(stop <= a.slot_width, "paged_decode: kv_lens[", i, "] = ", stop,
                " exceeds the slot table's width ", a.slot_width);
    keys[i] = std::max<int64_t>(stop - start, 0);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t t = i * kv_heads + h;
      cost[t + 1] = cost[t] + keys[i] + kTaskCost;
    }
  }
  const int64_t total = cost[tasks];
  const int64_t pieces =
      std::clamp<int64_t>(total / kMinPiece, 1, std::max(at::get_num_threads(), 1));
  // A task cut by a piece's ends keeps each part's state in a record: at most two per piece
  // (its first task and its last), in piece order, merged once every piece is done.
  const int64_t state_floats = group * (dim + 2);
  std::vector<float> records(2 * pieces * state_floats);
  std::vector<int64_t> record_task(2 * pieces, -1);
  auto record = [&](float* base) { return State{base, base + group, base + 2 * group}; };

  at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    Scratch w(group, dim);
    std::vector<float> own(state_floats), acc(dim);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = total * p / pieces, hi = total * (p + 1) / pieces;
      int64_t t = std::upper_bound(cost.begin(), cost.end(), lo) - cost.begin() - 1;
      for (; t < tasks && cost[t] < hi; ++t) {
        const int64_t i = t / kv_heads, n = keys[i];
        const int64_t j0 = std::clamp<int64_t>(lo - cost[t], 0, n);
        const int64_t j1 = std::clamp<int64_t>(hi - cost[t], 0, n);
        if (j0 == j1 && !(n == 0 && cost[t] >= lo)) continue;  // a keyless task: once
        const bool whole = j0 == 0 && j1 == n;
        const int64_t r = 2 * p + (j0 > 0 ? 0 : 1);
        const State st = record(whole ? own.data() : records.data() + r * state_floats);
        attend<TK, kDim, kBf16>(a, i, t % kv_heads, j0, j1, w, st);
        if (whole) {
          finish(a, t, &st, 1, acc.data());
        } else {
          record_task[r] = t;
        }
      }
    }
  });

  std::vector<State> parts;
  std::vector<float> acc(dim);
  for (int64_t r = 0; r < 2 * pieces; ++r) {
    if (record_task[r] < 0) continue;
    parts.push_back(record(records.data() + r * state_floats));
    int64_t next = r + 1;
    while (next < 2 * pieces && record_task[next] < 0) ++next;
    if (next == 2 * pieces || record_task[next] != record_task[r]) {  // the task's last part
      finish(a, record_task[r], parts.data(), static_cast<int64_t>(parts.size()), acc.data());
      parts.clear();
    }
  }
}

// bf16 keys under bf16 queries: the dots in bf16 pairs (exact products) where the CPU can.
template <typename TK, int64_t kDim>
void dispatch_dot(const PagedDecodeArgs& a) {
  if constexpr (kBf16Dot && std::is_same_v<TK, BF16>) {
    if (a.dtype == Dtype::bf16) return decode<TK, kDim, true>(a);
  }
  decode<TK, kDim, false>(a);
}

template <typename TK>
void dispatch_dim(const PagedDecodeArgs& a) {
  switch (a.dim) {
    case 64: dispatch_dot<TK, 64>(a); break;
    case 128: dispatch_dot<TK, 128>(a); break;
    case 256: dispatch_dot<TK, 256>(a); break;
    default: decode<TK, 0, false>(a);
  }
}

// The largest finite value of a cache format: fp8 stores saturate there (e4m3fn has no
// infinity, and c10's conversion would make an out-of-range value NaN).
template <typename TD>
constexpr float kSaturate = std::numeric_limits<float>::infinity();
template <>
constexpr float kSaturate<E4M3> = 448.0f;
template <>
constexpr float kSaturate<E5M2> = 57344.0f;

template <typename TS, typename TD>
void store_converted(const StoreRowsArgs& a) {
  const TS* src = static_cast<const TS*>(a.src);
  TD* dst = static_cast<TD*>(a.dst);
  const float inv = 1.0f / a.scale;
  const float hi = kSaturate<TD>;
  for (int64_t r = 0; r < a.rows; ++r) {
    const TS* s = src + r * a.src_stride;
    TD* d = dst + a.slots[r] * a.dst_stride;
    for (int64_t e = 0; e < a.row_elements; ++e) {
      d[e] = static_cast<TD>(std::clamp(to_float(s[e]) * inv, -hi, hi));
    }
  }
}

}  // namespace

// The cache holds the queries' type, bf16 (a bf16 cache under float32 weights) or fp8.
void paged_decode(const PagedDecodeArgs& a) {
  switch (a.kv_dtype) {
    case Dtype::f32: dispatch_dim<float>(a); break;
    case Dtype::bf16: dispatch_dim<BF16>(a); break;
    case Dtype::f16: dispatch_dim<Half>(a); break;
    case Dtype::f8e4m3: dispatch_dim<E4M3>(a); break;
    case Dtype::f8e5m2: dispatch_dim<E5M2>(a); break;
  }
}

void store_rows(const StoreRowsArgs& a) {
  if (a.src_dtype == a.dst_dtype) {
    const int64_t bytes = dtype_bytes(a.src_dtype);
    const char* src = static_cast<const char*>(a.src);
    char* dst = static_cast<char*>(a.dst);
    for (int64_t r = 0; r < a.rows; ++r) {
      std::memcpy(dst + a.slots[r] * a.dst_stride * bytes, src + r * a.src_stride * bytes,
                  a.row_elements * bytes);
    }
    return;
  }
  switch (a.dst_dtype) {
    case Dtype::bf16:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, BF16>(a));
      break;
    case Dtype::f8e4m3:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, E4M3>(a));
      break;
    case Dtype::f8e5m2:
      PLUGSERVE_FLOAT_TYPES(a.src_dtype, "store_rows", store_converted<T, E5M2>(a));
      break;
    default: TORCH_CHECK(false, "store_rows: converts to bf16 and fp8 caches only");
  }
}

PLUGSERVE_ISA_END
