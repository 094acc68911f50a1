// The decoder's elementwise steps in one pass each, on the CPU: RMSNorm, residual add + RMSNorm,
// SiLU(gate) * up, and the rotary embedding of q and k.
//
// Each kernel reproduces the torch code it replaces, rounding where that code rounds:
//   rms_norm      x32 = float(x); r = 1 / sqrt(sum(x32^2) / n + eps); y = x32 * r, then
//                 Llama: T(float(w) * float(T(y)))  (the multiply by w in the input dtype),
//                 Gemma (unit_offset): T(y * (1 + float(w))).
//   add_rms_norm  h = T(float(residual) + float(x)); returns (rms_norm(h), h).
//   silu_mul      s = T(g / (1 + exp(-g))); returns T(float(s) * float(u)), g and u the two
//                 halves of the last dim.
//   rope_         in place, for a, b the two halves of each head and c, s the cos and sin of
//                 its token: a' = T(T(a c) - T(b s)), b' = T(T(b c) + T(a s)) (HF's
//                 q * cos + rotate_half(q) * sin, op by op). Products are not fused into
//                 FMAs here (see below): float32 results must be torch's to the bit.
// T is float32, bfloat16 or float16; all arithmetic is in float32 (the sum of squares too,
// in vector lanes, so its rounding differs from torch's by an ulp or so of float32).
//
// Rows (every index but the last) run in parallel; the last dim must be contiguous (a strided
// one is copied first), the others may have any strides, so a view such as the q heads split
// out of a fused qkv projection is read where it lies. Outputs are new contiguous tensors.
//
// The Python side (plugserve/kernels/fused_elementwise.py) holds the references these are
// tested against and decides when to use them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "vec_exp.h"

namespace {

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

int64_t rows_of(const torch::Tensor& t) {
  const int64_t last = t.size(-1);
  return last == 0 ? 0 : t.numel() / last;
}

// Rows of about this many elements go to one task: fewer would cost more to hand out.
int64_t grain(int64_t row_elements) {
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

torch::Tensor last_dim_contiguous(const torch::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

void check_input(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() >= 1, what, ": the input needs at least one dim");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              what, ": unsupported dtype ", dtype);
}

void check_weight(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), what, ": the weight must be [",
              x.size(-1), "]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": the weight's dtype differs");
}

#define DISPATCH_DTYPE(dtype, what, ...)                                           \
  switch (dtype) {                                                                 \
    case torch::kFloat: { using T = float; __VA_ARGS__; break; }                   \
    case torch::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }        \
    case torch::kHalf: { using T = c10::Half; __VA_ARGS__; break; }                \
    default: TORCH_CHECK(false, what, ": unsupported dtype ", dtype);              \
  }

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool unit_offset) {
  check_input(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  x = last_dim_contiguous(x);
  weight = weight.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  DISPATCH_DTYPE(x.scalar_type(), "rms_norm",
                 rms_norm_kernel<T>(x, weight, eps, unit_offset, out));
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps,
                                                      bool unit_offset) {
  check_input(x, "add_rms_norm");
  check_weight(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
              residual.device().is_cpu(), "add_rms_norm: x and residual differ in shape or dtype");
  x = last_dim_contiguous(x);
  residual = last_dim_contiguous(residual);
  weight = weight.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  auto new_residual = torch::empty(x.sizes(), x.options());
  DISPATCH_DTYPE(x.scalar_type(), "add_rms_norm",
                 add_rms_norm_kernel<T>(x, residual, weight, eps, unit_offset, out,
                                        new_residual));
  return {out, new_residual};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_input(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dim (gate | up) must be even");
  gate_up = last_dim_contiguous(gate_up);
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  auto out = torch::empty(sizes, gate_up.options());
  DISPATCH_DTYPE(gate_up.scalar_type(), "silu_mul", silu_mul_kernel<T>(gate_up, out));
  return out;
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_input(x, "rope_");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope_: x must be [tokens, heads, head_dim] with an even, contiguous head_dim, got ",
              x.sizes(), " with strides ", x.strides());
  const int64_t half = x.size(2) / 2;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rope_: cos/sin dtype ", t->scalar_type(),
                " differs from x's ", x.scalar_type());
    TORCH_CHECK(t->size(0) == x.size(0) && t->size(-1) == half && t->numel() == x.size(0) * half
                    && t->stride(-1) == 1,
                "rope_: cos and sin must hold ", half, " contiguous values per token for ",
                x.size(0), " tokens, got ", t->sizes());
  }
  DISPATCH_DTYPE(x.scalar_type(), "rope_", rope_kernel<T>(x, cos, sin));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_", &rope_, "rotary embedding of [tokens, heads, head_dim] in place (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual + x and its RMSNorm (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over the halves of the last dim (CPU)");
}
