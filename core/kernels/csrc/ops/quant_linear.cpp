// Linear ops over GGML block-quantized weights (kernels/quant_linear.cpp): the few-row kernel,
// the dequantization of weight rows, and the many-row path, which dequantizes a tile of
// weight rows at a time into x's dtype and runs the dense GEMM over it (the whole matrix is
// never dequantized at once).
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <string>

#include "common.h"

namespace plugserve::ops {
namespace {

QuantFormat format_of(const std::string& name) {
  static const char* kNames[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"};
  for (int i = 0; i < 8; ++i) {
    if (name == kNames[i]) return static_cast<QuantFormat>(i);
  }
  TORCH_CHECK(false, "quant_linear: unknown block format '", name,
              "'; allowed: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k");
}

// w must be uint8 [rows, cols / block_elems * block_bytes], rows contiguous.
at::Tensor checked_blocks(at::Tensor w, QuantFormat f, const std::string& name, int64_t cols,
                          const char* what) {
  const int64_t elems = quant_block_elems(f);
  TORCH_CHECK(cols % elems == 0, what, ": ", cols, " columns is not a multiple of ", name,
              "'s block of ", elems);
  const int64_t row_bytes = cols / elems * quant_block_bytes(f);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == row_bytes, what,
              ": ", name, " blocks of ", cols, " columns must be uint8 [rows, ", row_bytes,
              "], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.device().is_cpu(), what, ": CPU tensors only");
  return w.contiguous();
}

at::Tensor checked_x(at::Tensor x, const char* what) {
  TORCH_CHECK(x.dim() == 2, what, ": x must be 2-d [rows, cols], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  return x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
}

void dequantize_into(const at::Tensor& w, QuantFormat f, int64_t cols, at::Tensor& out) {
  QuantDequantizeArgs a{};
  a.w = w.data_ptr<uint8_t>();
  a.w_row_bytes = w.size(1);
  a.out = out.data_ptr();
  a.rows = w.size(0);
  a.K = cols;
  a.format = f;
  a.dtype = float_dtype(out, "quant_dequantize");
  if (a.rows > 0 && cols > 0) kernels().quant_dequantize(a);
}

at::Tensor quant_dequantize(at::Tensor w, const std::string& format, int64_t cols,
                            at::ScalarType dtype) {
  const QuantFormat f = format_of(format);
  w = checked_blocks(w, f, format, cols, "quant_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "quant_dequantize: float32 or bfloat16 output only, got ", dtype);
  auto out = at::empty({w.size(0), cols}, w.options().dtype(dtype));
  dequantize_into(w, f, cols, out);
  return out;
}

// x rounded through int8 per 32-block, as the few-row kernel does (reference:
// plugserve.quant.reference.quantize_activations_int8), in x's dtype.
at::Tensor round_activations_int8(const at::Tensor& x) {
  const auto blocks = x.to(at::kFloat).reshape({x.size(0), x.size(1) / 32, 32});
  const auto scale = std::get<0>(blocks.abs().max(-1, true)).div(127.0);
  const auto q = at::where(scale.gt(0), blocks.div(scale), at::zeros_like(blocks)).round();
  const auto scale16 = scale.to(at::kHalf).to(at::kFloat);
  return q.mul(scale16).reshape(x.sizes()).to(x.scalar_type());
}

at::Tensor quant_gemm(at::Tensor x, at::Tensor w, const std::string& format,
                      const std::optional<at::Tensor>& bias, bool int8_activations,
                      int64_t tile_rows) {
  const QuantFormat f = format_of(format);
  x = checked_x(x, "quant_gemm");
  w = checked_blocks(w, f, format, x.size(1), "quant_gemm");
  TORCH_CHECK(tile_rows > 0, "quant_gemm: tile_rows must be positive, got ", tile_rows);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K % 32 == 0 && int8_activations) x = round_activations_int8(x);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_gemm: bias has ", bias->numel(), " values for ", N,
                " outputs");
    b = bias->to(x.scalar_type()).reshape({N});
  }
  const int64_t tile = std::min(tile_rows, N);
  auto w_tile = at::empty({tile, K}, x.options());
  auto out_tile = at::empty({M, tile}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t rows = std::min(tile, N - n0);
    auto wt = w_tile.narrow(0, 0, rows);
    dequantize_into(w.narrow(0, n0, rows), f, K, wt);
    auto ot = out_tile.narrow(1, 0, rows);
    if (b.defined()) {
      at::addmm_out(ot, b.narrow(0, n0, rows), x, wt.t());
    } else {
      at::mm_out(ot, x, wt.t());
    }
    out.narrow(1, n0, rows).copy_(ot);
  }
  return out;
}

}  // namespace

at::Tensor quant_linear(at::Tensor x, at::Tensor w, const std::string& format,
                        const std::optional<at::Tensor>& bias, bool int8_activations) {
  const QuantFormat f = format_of(format);
  x = checked_x(x, "quant_linear");
  w = checked_blocks(w, f, format, x.size(1), "quant_linear");
  const auto bias32 = bias_as_float(bias, w.size(0), "quant_linear");
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return out;
  QuantLinearArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w = w.data_ptr<uint8_t>();
  a.w_row_bytes = w.size(1);
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = w.size(0);
  a.format = f;
  a.dtype = float_dtype(x, "quant_linear");
  a.int8_activations = int8_activations;
  kernels().quant_linear(a);
  return out;
}

}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor w, str format, Tensor? bias, bool int8_activations) "
        "-> Tensor", &plugserve::ops::quant_linear);
  m.def("quant_dequantize(Tensor w, str format, int cols, ScalarType dtype) -> Tensor",
        &plugserve::ops::quant_dequantize);
  m.def("quant_gemm(Tensor x, Tensor w, str format, Tensor? bias, bool int8_activations, "
        "int tile_rows) -> Tensor", &plugserve::ops::quant_gemm);
}
