// Decode attention straight from the paged KV cache, and the KV store before it.
//
// One query token per row q[i] ([heads, head_dim]) attends to the keys at
// slots[i, first_key[i] : kv_lens[i]] of the cache buffers k/v ([slots, kv_heads, head_dim]).
// Nothing is gathered: each row's task reads its keys and values where they lie, once (a
// key's rows of all kv heads together: one run of kv_heads x head_dim elements), widening
// bf16 / fp16 / fp8 to float32 on the fly, and computes the softmax in float32 for all query
// heads, each against its group's kv head (grouped-query attention). The output has q's
// dtype. The two passes of a task (scores, then values) are in paged_decode_passes.h.
//
// Work split: the rows' keys, laid end to end (plus kTaskCost per row), are cut into one
// equal piece per thread, so rows of unequal lengths balance and a long row is shared by
// the threads (flash decoding): a row cut by a piece's end leaves each part's running max,
// sum and unnormalised output, merged once the pieces are done.
//
// Measured (benchmarks/paged_decode_speed.py, SmolLM2-135M's 9 / 3 heads x 64, 30 layers'
// buffers, engine-like slots; avx512_bf16 copy, 2 threads of a Xeon with AVX-512 BF16), us per
// call before -> after this split, the bf16 dots and the 16-key lane sums:
//   64 x 250 keys      bf16 888 -> 786   fp32 1337 -> 1379 (noise: the K/V stream is the limit)
//   64 x 16..512 keys  bf16 947 -> 831   fp32 1430 -> 1341
//   8 x 500            bf16 131 -> 120   fp32  246 -> 249
//   1 x 1024           bf16  40 ->  33   fp32   61 ->  44
// One task per row instead of per (row, kv head), each key's 384-byte bf16 run of the 3 kv
// heads read at once, and the score prefetch 8 keys ahead instead of 24 (the same lines):
// 2 threads, alternating runs of the old and new library, best of 11: 64 x 250 bf16
// 806-940 -> 731-781, 64 x 16..512 bf16 820-898 -> 744-838, 1 x 1024 bf16 42 -> 33; one
// thread (the other core busy), best of 7: 64 x 250 bf16 1665-1888 -> 1488-1614, 64 x
// 16..512 bf16 1621-1991 -> 1579-1855, 8 x 500 bf16 367-459 -> 310-364, fp32 unchanged
// (64 x 250 2935-3079 -> 2627-2986, 64 x 16..512 3049-3057 -> 2941-3036).
// The reads are bound by the lines in flight, not by the arithmetic: software prefetches
// each hold a fill buffer, so prefetching further (48 or 64 keys), nearer (12), only every
// other line, or a whole block of keys at once all measured slower; a one-pass online
// softmax over blocks of 16 keys (each block's keys and values touched once, in L1) measured
// 5-50% slower than these two passes with their prefetch (then 24 keys of one kv head).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "paged_decode_passes.h"
#include "work_share.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using namespace paged;

// A row costs its keys plus this many (loading q, storing the output) when the work is
// cut into one piece per thread; no piece is smaller than kMinPiece keys. With 96 a single
// row of up to ~180 keys ran on one thread: at batch 1 (us per call from Python, 2 threads,
// float32 KV, benchmarks/paged_decode_speed.py --contiguous, two runs each) 32 took 1 x 140
// keys 13.5-18.9 -> 10.7-11.0, 1 x 180 15.9-16.1 -> 12.6-12.7, 1 x 100 and 1 x 250 the same.
constexpr int64_t kTaskCost = 8;
constexpr int64_t kMinPiece = 32;

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
  Scratch(int64_t heads, int64_t dim)
      : qf(heads * dim), kv_row(dim), dots(heads * kBlock * kWidth, 0.f), qb(heads * dim) {}
};

// The softmax state of one row's query heads over some of its keys: running max, sum of
// e^(score - max), and the output not yet divided by that sum ([heads, dim]).
struct State {
  float* m;
  float* l;
  float* acc;
};

// Keys [j0, j1) (counted from first_key) of row i for all its query heads: each key's rows
// of all kv heads are read together (one run of kv_heads x dim elements in the usual layout).
template <typename TK, int64_t kDim, bool kBf16>
void attend(const PagedDecodeArgs& a, int64_t i, int64_t j0, int64_t j1, Scratch& w,
            const State& st) {
  const int64_t heads = a.heads, kv_heads = a.kv_heads, group = heads / kv_heads;
  const int64_t dim = kDim > 0 ? kDim : a.dim;  // a constant lets the compiler unroll
  const int64_t n = j1 - j0;
  const int64_t start = std::max<int64_t>(a.first_key[i], 0) + j0;
  const int64_t* row_slots = a.slots + i * a.slot_stride + start;
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(row_slots[j] >= 0 && row_slots[j] < a.num_slots, "paged_decode: slot ",
                row_slots[j], " of query ", i, " is outside the cache [0, ", a.num_slots, ")");
  }
  load_query(a, i * heads * dim, w.qf.data(), heads * dim);
  if constexpr (kBf16) {
    std::copy_n(static_cast<const BF16*>(a.q) + i * heads * dim, heads * dim, w.qb.data());
  }
  w.scores.resize(heads * n);  // every entry is written below
  float* scores = w.scores.data();
  std::fill_n(st.m, heads, -std::numeric_limits<float>::infinity());
  const TK* k_base = static_cast<const TK*>(a.k);
  const TK* v_base = static_cast<const TK*>(a.v);
  constexpr bool kVector = kDim > 0 && kDim % (4 * kWidth) == 0;
  if constexpr (kVector) {
    scores_vec<TK, kDim, kBf16>(w.qf.data(), w.qb.data(), kv_heads, group, k_base,
                                a.k_head_stride, row_slots, n, a.k_token_stride, a.scale,
                                a.k_scale, scores, st.m, v_base, a.v_head_stride,
                                a.v_token_stride, w.dots.data());
  } else {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        load_row(k_base + row_slots[j] * a.k_token_stride + h * a.k_head_stride,
                 w.kv_row.data(), dim, a.k_scale);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
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
  }
  for (int64_t g = 0; g < heads; ++g) {
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
    for (int64_t h = 0; h < kv_heads; ++h) {
      values_vec<TK, kDim>(scores + h * group * n, n, group, v_base + h * a.v_head_stride,
                           row_slots, a.v_token_stride, a.v_scale, st.acc + h * group * dim);
    }
  } else {
    std::fill_n(st.acc, heads * dim, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        load_row(v_base + row_slots[j] * a.v_token_stride + h * a.v_head_stride,
                 w.kv_row.data(), dim, a.v_scale);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          float* __restrict o = st.acc + g * dim;
          const float p = scores[g * n + j];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += p * w.kv_row[d];
        }
      }
    }
  }
}

// Row i's output: the states of its pieces (one when it was not cut) merged and divided by
// their sum. A row with no keys (l == 0) gets zeros, as a fully masked softmax does not.
void finish(const PagedDecodeArgs& a, int64_t i, const State* states, int64_t count,
            float* acc) {
  const int64_t heads = a.heads, dim = a.dim;
  for (int64_t g = 0; g < heads; ++g) {
    const int64_t offset = (i * heads + g) * dim;
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
  const int64_t heads = a.heads, dim = a.dim;
  const int64_t tasks = a.rows;
  // Row t covers [cost[t], cost[t + 1]) of the rows' keys laid end to end (plus kTaskCost
  // each).
  std::vector<int64_t> cost(tasks + 1, 0), keys(a.rows);
  for (int64_t i = 0; i < a.rows; ++i) {
    const int64_t start = std::max<int64_t>(a.first_key[i], 0), stop = a.kv_lens[i];
    TORCH_CHECK(stop <= a.slot_width, "paged_decode: kv_lens[", i, "] = ", stop,
                " exceeds the slot table's width ", a.slot_width);
    keys[i] = std::max<int64_t>(stop - start, 0);
    cost[i + 1] = cost[i] + keys[i] + kTaskCost;
  }
  const int64_t total = cost[tasks];
  const int64_t pieces =
      std::clamp<int64_t>(total / kMinPiece, 1, work_share::threads());
  // A row cut by a piece's ends keeps each part's state in a record: at most two per piece
  // (its first row and its last), in piece order, merged once every piece is done.
  const int64_t state_floats = heads * (dim + 2);
  std::vector<float> records(2 * pieces * state_floats);
  std::vector<int64_t> record_task(2 * pieces, -1);
  auto record = [&](float* base) { return State{base, base + heads, base + 2 * heads}; };

  work_share::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    Scratch w(heads, dim);
    std::vector<float> own(state_floats), acc(dim);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = total * p / pieces, hi = total * (p + 1) / pieces;
      int64_t t = std::upper_bound(cost.begin(), cost.end(), lo) - cost.begin() - 1;
      for (; t < tasks && cost[t] < hi; ++t) {
        const int64_t n = keys[t];
        const int64_t j0 = std::clamp<int64_t>(lo - cost[t], 0, n);
        const int64_t j1 = std::clamp<int64_t>(hi - cost[t], 0, n);
        if (j0 == j1 && !(n == 0 && cost[t] >= lo)) continue;  // a keyless row: once
        const bool whole = j0 == 0 && j1 == n;
        const int64_t r = 2 * p + (j0 > 0 ? 0 : 1);
        const State st = record(whole ? own.data() : records.data() + r * state_floats);
        attend<TK, kDim, kBf16>(a, t, j0, j1, w, st);
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
    if (next == 2 * pieces || record_task[next] != record_task[r]) {  // the row's last part
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
