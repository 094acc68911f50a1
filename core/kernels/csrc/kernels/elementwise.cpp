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
// source is the AVX2, AVX-512 and scalar copy (compiled with -fno-trapping-math, compile.py's
// SOURCE_FLAGS, so that AVX2 vectorises their selects too). Rows run in parallel. The exception: bf16 in
// the AVX512-BF16 copy, where the norms' scaling, rope and SiLU * up round with one
// instruction each (vec::round_bf16: subnormals become zero), and SiLU * up takes a cheaper
// exp and reciprocal (silu_mul_row_bf16: within one bf16 ulp of the above).
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
#if defined(__AVX512BF16__)
  // bf16 with AVX512-BF16: the roundings as one instruction each (round_bf16), the plain
  // loop below only for the last n % 16 values.
  if constexpr (std::is_same_v<T, BF16>) {
    const F vr(r), one(1.f);
    const int64_t whole = n / kWidth * kWidth;
    for (int64_t d = 0; d < whole; d += kWidth) {
      const F xv = load(x + d), wv = load(w + d);
      store_bf16(out + d, unit_offset ? xv * vr * (one + wv) : wv * round_bf16(xv * vr));
    }
    x += whole, w += whole, out += whole, n -= whole;
  }
#endif
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

#if defined(__AVX512BF16__)
// bf16 on a CPU with AVX512-BF16, whose result is rounded to bf16 (8 bits) twice: cheaper
// steps whose float32 errors stay far below that rounding, 1.4-1.7x faster than the plain loop
// (which emulates each rounding in integer steps and divides). e^-g as 2^(-g log2 e) with the
// product's rounding error carried (vec::exp2, 2e-7 relative), the division as a reciprocal
// estimate refined by one Newton step (~2 float32 ulps), each rounding to bf16 one
// instruction (vcvtneps2bf16: to nearest even as c10, but a subnormal value becomes zero; a
// NaN stays a NaN, its payload may differ). Over every bf16 gate value the rounded SiLU
// equals torch's except subnormal SiLU values (zero here) and g = 5.9375, whose exact value
// lies 1.5e-6 above a rounding midpoint (rounded up here, down by torch's float32 steps).
inline void silu_mul_row_bf16(const BF16* __restrict gate, const BF16* __restrict up,
                              BF16* __restrict o, int64_t width) {
  const __m512 minus_log2e = _mm512_set1_ps(-1.44269504088896341f);
  const __m512 minus_log2e_lo = _mm512_set1_ps(-1.925963033500011e-08f);
  const __m512 ln2 = _mm512_set1_ps(0.693147180559945309f);
  int64_t d = 0;
  for (; d + kWidth <= width; d += kWidth) {
    const F g = load(gate + d);
    // -g log2 e as a float32 sum hi + lo (the product's rounding error recovered by an FMA,
    // log2 e's own in minus_log2e_lo), and 2^(hi + lo) = 2^hi (1 + lo ln 2): an infinite 2^hi
    // times that finite factor stays infinite. g is clamped to +-150 first, where e^-g is
    // already 0 or past float32's range (no inf - inf in lo).
    const __m512 gc = _mm512_min_ps(_mm512_max_ps(g, _mm512_set1_ps(-150.f)),
                                    _mm512_set1_ps(150.f));
    const __m512 hi = _mm512_mul_ps(gc, minus_log2e);
    const __m512 lo = _mm512_fmadd_ps(gc, minus_log2e_lo, _mm512_fmsub_ps(gc, minus_log2e, hi));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 den = _mm512_fmadd_ps(exp2(F(hi)), _mm512_fmadd_ps(lo, ln2, one), one);
    __m512 q;
    if (_mm512_cmp_ps_mask(den, _mm512_set1_ps(0x1p120f), _CMP_GE_OQ) == 0) {
      __m512 r = _mm512_rcp14_ps(den);
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(2.f)));
      q = _mm512_mul_ps(g, r);
    } else {  // g below about -83 in some lane: 1 / den near or past the subnormals
      q = _mm512_div_ps(g, den);
    }
    store_bf16(o + d, round_bf16(F(q)) * load(up + d));
  }
  for (; d < width; ++d) {
    const float g = to_float(gate[d]);
    const float s = round_to<BF16>(g / (1.f + exp_f32(-g)));
    o[d] = from_float<BF16>(s * to_float(up[d]));
  }
}
#endif

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
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {
        silu_mul_row_bf16(gate, up, o, width);
        continue;
      }
#endif
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
      int64_t d0 = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {  // the roundings as one instruction each
        for (; d0 + kWidth <= half; d0 += kWidth) {
          const F av = load(pa + d0), bv = load(pb + d0), cv = load(c + d0), sv = load(s + d0);
          store_bf16(pa + d0, round_bf16(av * cv) - round_bf16(bv * sv));
          store_bf16(pb + d0, round_bf16(bv * cv) + round_bf16(av * sv));
        }
      }
#endif
#pragma omp simd
      for (int64_t d = d0; d < half; ++d) {
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
