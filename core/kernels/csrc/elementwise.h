// The elementwise kernels of fused_elementwise.cpp (which documents what each computes and
// where it rounds), shared with decode_layer.cpp, which chains them with the linears.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_exp.h"

namespace plugserve::elementwise {


// Conversions to and from float32, written so that loops over them vectorise.
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16);
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  // Round to nearest even, NaN to the canonical quiet NaN: c10's conversion, branch-free.
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = v != v ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

#ifdef __FLT16_MAX__  // the compiler's own IEEE half type: conversions it vectorises (F16C)
inline float to_float(c10::Half v) {
  return static_cast<float>(__builtin_bit_cast(_Float16, v.x));
}
template <>
inline c10::Half from_float<c10::Half>(float v) {
  return c10::Half(__builtin_bit_cast(uint16_t, static_cast<_Float16>(v)), c10::Half::from_bits());
}
#else
inline float to_float(c10::Half v) { return static_cast<float>(v); }
template <>
inline c10::Half from_float<c10::Half>(float v) { return c10::Half(v); }
#endif

// v rounded to T and widened back: what a torch op with a T output hands to the next op.
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

// Where row i of a tensor starts: every dim but the last, with its own stride. Dims that are
// laid out one after another are merged, so a contiguous or 2-d tensor is one multiply.
class Rows {
 public:
  explicit Rows(const torch::Tensor& t) {
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      const int64_t size = t.size(d), stride = t.stride(d);
      if (size == 1) continue;
      if (!sizes_.empty() && strides_.back() == stride * size) {
        sizes_.back() *= size;
        strides_.back() = stride;
      } else {
        sizes_.push_back(size);
        strides_.push_back(stride);
      }
    }
  }
  int64_t offset(int64_t row) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d > 0; --d) {
      off += (row % sizes_[d]) * strides_[d];
      row /= sizes_[d];
    }
    return sizes_.empty() ? 0 : off + row * strides_[0];
  }

 private:
  std::vector<int64_t> sizes_, strides_;
};

inline int64_t rows_of(const torch::Tensor& t) {
  const int64_t last = t.size(-1);
  return last == 0 ? 0 : t.numel() / last;
}

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

template <typename T>
inline float sum_of_squares(const T* __restrict x, int64_t n) {
  return lane_sum(n, [x](int64_t d) {
    const float v = to_float(x[d]);
    return v * v;
  });
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
void rms_norm_kernel(const torch::Tensor& x, const torch::Tensor& w, double eps,
                     bool unit_offset, torch::Tensor& out) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  const Rows in_rows(x);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = w.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x_ptr + in_rows.offset(i);
      scale_row(row, w_ptr, out_ptr + i * n, n, sum_of_squares(row, n), feps, unit_offset);
    }
  });
}

template <typename T>
void add_rms_norm_kernel(const torch::Tensor& x, const torch::Tensor& residual,
                         const torch::Tensor& w, double eps, bool unit_offset,
                         torch::Tensor& out, torch::Tensor& new_residual) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  const Rows x_rows(x), res_rows(residual);
  const T* x_ptr = x.data_ptr<T>();
  const T* res_ptr = residual.data_ptr<T>();
  const T* w_ptr = w.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  T* sum_ptr = new_residual.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict a = x_ptr + x_rows.offset(i);
      const T* __restrict b = res_ptr + res_rows.offset(i);
      T* __restrict h = sum_ptr + i * n;
      const float sum = lane_sum(n, [a, b, h](int64_t d) {
        const float v = round_to<T>(to_float(b[d]) + to_float(a[d]));
        h[d] = from_float<T>(v);
        return v * v;
      });
      scale_row(h, w_ptr, out_ptr + i * n, n, sum, feps, unit_offset);
    }
  });
}

template <typename T>
void silu_mul_kernel(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t width = out.size(-1), rows = rows_of(gate_up);
  const Rows in_rows(gate_up);
  const T* in_ptr = gate_up.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict gate = in_ptr + in_rows.offset(i);
      const T* __restrict up = gate + width;
      T* __restrict o = out_ptr + i * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        const float g = to_float(gate[d]);
        const float s = round_to<T>(g / (1.f + plugserve::exp_f32(-g)));
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
void rope_kernel(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  T* x_ptr = x.data_ptr<T>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  at::parallel_for(0, tokens * heads, grain(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads, h = task % heads;
      T* __restrict a = x_ptr + t * token_stride + h * head_stride;
      T* __restrict b = a + half;
      const T* __restrict c = cos_ptr + t * cos_stride;
      const T* __restrict s = sin_ptr + t * sin_stride;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float av = to_float(a[d]), bv = to_float(b[d]);
        const float cv = to_float(c[d]), sv = to_float(s[d]);
        a[d] = from_float<T>(round_to<T>(av * cv) - round_to<T>(bv * sv));
        b[d] = from_float<T>(round_to<T>(bv * cv) + round_to<T>(av * sv));
      }
    }
  });
}
#pragma GCC pop_options

#define PLUGSERVE_DISPATCH_DTYPE(dtype, what, ...)                                 \
  switch (dtype) {                                                                 \
    case torch::kFloat: { using T = float; __VA_ARGS__; break; }                   \
    case torch::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }        \
    case torch::kHalf: { using T = c10::Half; __VA_ARGS__; break; }                \
    default: TORCH_CHECK(false, what, ": unsupported dtype ", dtype);              \
  }

}  // namespace plugserve::elementwise
