// The decoder's elementwise steps in one pass each: RMSNorm, residual add + RMSNorm,
// SiLU(gate) * up, and the rotary embedding of q and k.
//
// Each kernel reproduces the torch code it replaces, rounding where that code rounds:
//   rms_norm      x32 = float(x); r = 1 / sqrt(sum(x32^2) / n + eps); y = x32 * r, then
//                 Llama: T(float(w) * float(T(y)))  (the multiply by w in the input dtype),
//                 Gemma (unit_offset): T(y * (1 + float(w))).
//   add_rms_norm  h = T(float(residual) + float(x)); returns (rms_norm(h), h).
//   silu_mul      s = T(g / (1 + exp(-g))); returns T(float(s) * float(u)), g and u the two
//                 halves of the last dim.
//   rope          in place, for a, b the two halves of each head and c, s the cos and sin of
//                 its token: a' = T(T(a c) - T(b s)), b' = T(T(b c) + T(a s)) (HF's
//                 q * cos + rotate_half(q) * sin, op by op). Products are not fused into
//                 FMAs here (see below): float32 results must be torch's to the bit.
// T is float32, bfloat16 or float16; all arithmetic is in float32 (the sum of squares too,
// in vector lanes, so its rounding differs from torch's by an ulp or so of float32).
//
// These are plain loops (`omp simd`) the compiler vectorises for each ISA's flags: the same
// source is the AVX2, AVX-512 and scalar copy. Rows run in parallel.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../vec/pvec.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;

// Rows of about this many elements go to one task: fewer would cost more to hand out.
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

// sum(term(d) for d < n) in float32, over kLanes partial sums: several vector accumulators
// so that the adds do not wait on each other. `term` may also store (add_rms_norm's sum).
constexpr int64_t kLanes = 64;

template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) part[j] += term(d + j);
  }
  const int64_t tail = n - d;
#pragma omp simd
  for (int64_t j = 0; j < tail; ++j) part[j] += term(d + j);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return sum;
}

// out = the normed row x: x * r scaled by w as the Llama or Gemma norm scales it.
template <typename T>
inline void scale_row(const T* __restrict x, const T* __restrict w, T* __restrict out,
                      int64_t n, float sum, float eps, bool unit_offset) {
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
      out[d] = from_float<T>(to_float(x[d]) * r * (1.f + to_float(w[d])));
    }
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
      out[d] = from_float<T>(to_float(w[d]) * round_to<T>(to_float(x[d]) * r));
    }
  }
}

template <typename T>
void rms_norm_rows(const NormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out);
  const int64_t n = a.n;
  at::parallel_for(0, a.rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict row = x + a.x_rows.offset(i);
      const float sum = lane_sum(n, [row](int64_t d) {
        const float v = to_float(row[d]);
        return v * v;
      });
      scale_row(row, w, out + i * n, n, sum, a.eps, a.unit_offset);
    }
  });
}

template <typename T>
void add_rms_norm_rows(const NormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out);
  T* sums = static_cast<T*>(a.new_residual);
  const int64_t n = a.n;
  at::parallel_for(0, a.rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict xa = x + a.x_rows.offset(i);
      const T* __restrict rb = res + a.residual_rows.offset(i);
      T* __restrict h = sums + i * n;
      const float sum = lane_sum(n, [xa, rb, h](int64_t d) {
        const float v = round_to<T>(to_float(rb[d]) + to_float(xa[d]));
        h[d] = from_float<T>(v);
        return v * v;
      });
      scale_row(h, w, out + i * n, n, sum, a.eps, a.unit_offset);
    }
  });
}

template <typename T>
void silu_mul_rows(const SiluMulArgs& a) {
  const T* in = static_cast<const T*>(a.gate_up);
  T* out = static_cast<T*>(a.out);
  const int64_t width = a.width;
  at::parallel_for(0, a.rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict gate = in + a.rows_layout.offset(i);
      const T* __restrict up = gate + width;
      T* __restrict o = out + i * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        const float g = to_float(gate[d]);
        const float s = round_to<T>(g / (1.f + exp_f32(-g)));
        o[d] = from_float<T>(s * to_float(up[d]));
      }
    }
  });
}

// The rotation is written as torch computes it, one rounding per op: contracting a product
// and a sum into one FMA (GCC does by default) would change float32 results in the last bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_rows(const RopeArgs& a) {
  T* x = static_cast<T*>(a.x);
  const T* cos = static_cast<const T*>(a.cos);
  const T* sin = static_cast<const T*>(a.sin);
  const int64_t heads = a.heads, half = a.half;
  at::parallel_for(0, a.tokens * heads, grain(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads, h = task % heads;
      T* __restrict pa = x + t * a.token_stride + h * a.head_stride;
      T* __restrict pb = pa + half;
      const T* __restrict c = cos + t * a.cos_stride;
      const T* __restrict s = sin + t * a.sin_stride;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float av = to_float(pa[d]), bv = to_float(pb[d]);
        const float cv = to_float(c[d]), sv = to_float(s[d]);
        pa[d] = from_float<T>(round_to<T>(av * cv) - round_to<T>(bv * sv));
        pb[d] = from_float<T>(round_to<T>(bv * cv) + round_to<T>(av * sv));
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

void rms_norm(const NormArgs& a) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "rms_norm", rms_norm_rows<T>(a));
}

void add_rms_norm(const NormArgs& a) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "add_rms_norm", add_rms_norm_rows<T>(a));
}

void silu_mul(const SiluMulArgs& a) {
  PLUGSERVE_FLOAT_TYPES(a.dtype, "silu_mul", silu_mul_rows<T>(a));
}

void rope(const RopeArgs& a) { PLUGSERVE_FLOAT_TYPES(a.dtype, "rope_", rope_rows<T>(a)); }

PLUGSERVE_ISA_END
