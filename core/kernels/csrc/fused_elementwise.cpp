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

#include <tuple>

#include "elementwise.h"

namespace {

using namespace plugserve::elementwise;

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

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool unit_offset) {
  check_input(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  x = last_dim_contiguous(x);
  weight = weight.contiguous();
  auto out = torch::empty(x.sizes(), x.options());
  PLUGSERVE_DISPATCH_DTYPE(x.scalar_type(), "rms_norm",
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
  PLUGSERVE_DISPATCH_DTYPE(x.scalar_type(), "add_rms_norm",
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
  PLUGSERVE_DISPATCH_DTYPE(gate_up.scalar_type(), "silu_mul", silu_mul_kernel<T>(gate_up, out));
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
  PLUGSERVE_DISPATCH_DTYPE(x.scalar_type(), "rope_", rope_kernel<T>(x, cos, sin));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_", &rope_, "rotary embedding of [tokens, heads, head_dim] in place (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual + x and its RMSNorm (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over the halves of the last dim (CPU)");
}
