// The dense bf16 linear on AMX tiles (kernels/dense_amx.cpp) against a weight packed once
// (plugserve.kernels.dense_amx.pack), and whether AMX runs here at all.
#include "common.h"

namespace plugserve::ops {
namespace {

constexpr int64_t kStrip = 32, kTileK = 32;

}  // namespace

// x [M, K] bf16 @ w.T (+ bias) -> [M, N] bf16, w [N, K] packed as `w_packed` (N rounded up
// to strips of 32 rows, K / 32 pairs of 16 x 32 tiles each).
at::Tensor dense_amx_linear(at::Tensor x, const at::Tensor& w_packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "dense_amx_linear: x must be a 2-d bfloat16 CPU tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t K = x.size(1), strips = (out_features + kStrip - 1) / kStrip;
  TORCH_CHECK(K % kTileK == 0 && K > 0, "dense_amx_linear: ", K,
              " input features is not a positive multiple of 32");
  TORCH_CHECK(w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() &&
                  w_packed.numel() == strips * kStrip * K,
              "dense_amx_linear: the packed weight must be ", strips * kStrip * K,
              " contiguous bfloat16 values for ", out_features, " x ", K, ", got ",
              w_packed.numel(), " ", w_packed.scalar_type());
  if (x.stride(1) != 1) x = x.contiguous();
  const auto bias32 = bias_as_float(bias, out_features, "dense_amx_linear");
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return out;
  DenseAmxArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w_packed = w_packed.data_ptr();
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = K;
  a.N = out_features;
  TORCH_CHECK(kernels().dense_amx_linear(a), "dense_amx_linear: the ", kernels().isa,
              " kernels have no AMX here (ask amx_usable() first)");
  return out;
}

namespace {

bool amx_usable() { return kernels().amx_usable(); }

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("dense_amx_linear(Tensor x, Tensor w_packed, int out_features, Tensor? bias) -> Tensor",
        &plugserve::ops::dense_amx_linear);
  m.def("amx_usable() -> bool", &plugserve::ops::amx_usable);
}
