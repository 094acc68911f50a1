// Linear ops: the few-row streaming linear (kernels/skinny_linear.cpp) and the GEMM that
// reads bf16 / fp16 weights as they are stored on CPUs without native half dot products
// (kernels/widening_gemm.cpp; from 128 rows on, float32 strips of the weight through the
// float32 GEMM), and the float32 panel GEMM for a few dozen rows
// (kernels/panel_gemm.cpp) with the packing of its weight.
#include <ATen/ops/zeros.h>

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

// From this many rows of x on, the weight is widened to float32 a strip at a time and
// multiplied by the float32 GEMM (oneDNN / MKL), which then runs 1.3-1.8x the widening
// kernel's speed (each strip is widened once for all the rows); below, the widening kernel
// (its register tiles read the weight as stored) is as fast or faster.
constexpr int64_t kWidenWholeRows = 128;

// out [M, N] (float32 or x's dtype) = x @ w.T + bias32, the weight widened strip by strip.
void widened_strips_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias32,
                         at::Tensor& out) {
  const auto x32 = x.to(at::kFloat);
  auto out32 = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), x32.options());
  gemm_by_weight_strips(x32, w.size(0), bias32, kWeightStripBytes, out32,
                        [&](int64_t n0, int64_t rows, at::Tensor& strip) {
                          strip.copy_(w.narrow(0, n0, rows));
                        });
  if (!out.is_same(out32)) out.copy_(out32);
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
  if (x.size(0) >= kWidenWholeRows) {
    widened_strips_gemm(x, w, bias32, out);
    return out;
  }
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

bool panel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// w [N, K] (float32, bf16 or fp16) as the panel GEMM of the ISA in use reads it:
// [panels][K][width] in w's dtype, the columns past N zero.
at::Tensor panel_gemm_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && panel_dtype(w.scalar_type()) && w.device().is_cpu(),
              "panel_gemm_pack: a 2-d float32, bf16 or fp16 CPU weight is needed, got ",
              w.sizes(), " ", w.scalar_type(), " on ", w.device());
  const int64_t width = kernels().panel_gemm_width();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + width - 1) / width;
  auto padded = at::zeros({panels * width, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, width, K}).transpose(1, 2).contiguous();
}

int64_t panel_gemm_width() { return kernels().panel_gemm_width(); }

}  // namespace

// x [M, K] (float32, bf16 or fp16) @ the weight packed by panel_gemm_pack (N columns) + bias
// -> [M, N] in x's dtype, summed in float32 (x widened to float32 first where it is half).
at::Tensor panel_gemm(at::Tensor x, const at::Tensor& packed, int64_t N,
                      std::optional<at::Tensor> bias) {
  const int64_t width = kernels().panel_gemm_width();
  TORCH_CHECK(x.dim() == 2 && panel_dtype(x.scalar_type()) && x.device().is_cpu(),
              "panel_gemm: x must be a 2-d float32, bf16 or fp16 CPU tensor, got ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && panel_dtype(packed.scalar_type()) &&
                  packed.is_contiguous() && packed.size(2) == width &&
                  packed.size(1) == x.size(1) && packed.size(0) * width >= N &&
                  (packed.size(0) - 1) * width < N,
              "panel_gemm: the packed weight ", packed.sizes(), " does not fit x ", x.sizes(),
              " and N = ", N, " (pack it with panel_gemm_pack in this process)");
  const auto out_dtype = x.scalar_type();
  if (out_dtype != at::kFloat) x = x.to(at::kFloat);
  if (x.size(1) > 0 && x.stride(1) != 1) x = x.contiguous();
  const auto bias32 = bias_as_float(bias, N, "panel_gemm");
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out.to(out_dtype);
  if (x.size(1) == 0) {  // an empty sum: the bias alone
    out.zero_();
    return (bias32.defined() ? out.add_(bias32) : out).to(out_dtype);
  }
  PanelGemmArgs a{};
  a.x = x.data_ptr<float>();
  a.x_stride = x.stride(0);
  a.packed = packed.data_ptr();
  a.w_dtype = float_dtype(packed, "panel_gemm");
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr<float>();
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = N;
  kernels().panel_gemm(a);
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor",
        &plugserve::ops::skinny_linear);
  m.def("widening_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor",
        &plugserve::ops::widening_gemm);
  m.def("panel_gemm_width() -> int", &plugserve::ops::panel_gemm_width);
  m.def("panel_gemm_pack(Tensor w) -> Tensor", &plugserve::ops::panel_gemm_pack);
  m.def("panel_gemm(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor",
        &plugserve::ops::panel_gemm);
}
