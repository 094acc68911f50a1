// Linear ops: the few-row streaming linear (kernels/skinny_linear.cpp) and the GEMM that
// reads bf16 / fp16 weights as they are stored on CPUs without native half dot products
// (kernels/widening_gemm.cpp).
#include "common.h"

namespace plugserve::ops {

void skinny_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias32,
                        at::Tensor& out) {
  SkinnyLinearArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w = w.data_ptr();
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = w.size(0);
  a.dtype = x.scalar_type() == at::kFloat ? Dtype::f32 : Dtype::bf16;
  kernels().skinny_linear(a);
}

namespace {

at::Tensor skinny_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x and w must be 2-d");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x has ", x.size(1), " columns, w has ",
              w.size(1));
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == w.scalar_type() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "skinny_linear: x and w must both be float32 or both bfloat16, got ",
              x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "skinny_linear: CPU tensors only");
  if (x.size(1) > 0 && x.stride(1) != 1) x = x.contiguous();
  w = w.contiguous();
  const auto bias32 = bias_as_float(bias, w.size(0), "skinny_linear");
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0 && w.size(0) > 0) skinny_linear_into(x, w, bias32, out);
  return out;
}

// x [M, K] (float32, bf16 or fp16) @ w [N, K].T (bf16 or fp16) + bias -> [M, N] in x's dtype.
at::Tensor widening_gemm(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "widening_gemm: x [M, K] and w [N, K] are needed, got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
              "widening_gemm: the weight must be bfloat16 or float16, got ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "widening_gemm: CPU tensors only");
  if (x.size(1) > 0 && x.stride(1) != 1) x = x.contiguous();
  w = w.contiguous();
  const auto bias32 = bias_as_float(bias, w.size(0), "widening_gemm");
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return out;
  WideningGemmArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w = w.data_ptr();
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = w.size(0);
  a.act_dtype = float_dtype(x, "widening_gemm");
  a.w_dtype = float_dtype(w, "widening_gemm");
  kernels().widening_gemm(a);
  return out;
}

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor",
        &plugserve::ops::skinny_linear);
  m.def("widening_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor",
        &plugserve::ops::widening_gemm);
}
