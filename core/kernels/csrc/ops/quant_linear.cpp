// Linear ops over GGML block-quantized weights: the few-row kernel (kernels/quant_linear.cpp),
// the dequantization of weight rows, and the many-row path (quant_gemm below): the AMX kernel
// (kernels/quant_amx.cpp) where it runs, else strips of dequantized weight rows (up to the
// whole matrix) through the dense GEMM, each strip's product written in place into out.
#include <ATen/ops/add.h>

#include <string>
#include <vector>

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

// out = x @ dequantize(w).T (+ bias) in x's dtype, in strips of at most strip_bytes of
// dequantized weight.
void strips_gemm(const at::Tensor& x, const at::Tensor& w, QuantFormat f,
                 const std::optional<at::Tensor>& bias, int64_t strip_bytes, at::Tensor& out) {
  const int64_t N = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(x.scalar_type()).reshape({N});
  gemm_by_weight_strips(x, N, b, strip_bytes, out,
                        [&](int64_t n0, int64_t rows, at::Tensor& strip) {
                          dequantize_into(w.narrow(0, n0, rows), f, x.size(1), strip);
                        });
}

// x as the dense GEMM of `dtype` (bf16 or float32) takes it: rounded through int8 per 32-block
// first when int8, in one compiled pass (x itself where it has that dtype already, rows
// contiguous, and is not rounded).
at::Tensor gemm_activations(const at::Tensor& x, bool int8, at::ScalarType dtype) {
  if (!int8 && x.scalar_type() == dtype && x.stride(1) == 1) return x;
  auto out = at::empty(x.sizes(), x.options().dtype(dtype));
  QuantActivationsArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.dtype = float_dtype(x, "quant_gemm");
  a.out_dtype = float_dtype(out, "quant_gemm");
  a.int8 = int8;
  kernels().quant_activations(a);
  return out;
}

// The kernel arguments for x [M, K] (float32 or bf16, rows contiguous), which the AMX kernel
// takes to bf16 and the VNNI one to int8 part by part where they multiply it.
QuantGemmArgs gemm_args(const at::Tensor& x, bool int8, const at::Tensor& w, QuantFormat f,
                        const at::Tensor& bias32, at::Tensor& out) {
  QuantGemmArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.x_dtype = float_dtype(x, "quant_gemm");
  a.int8 = int8;
  a.w = w.data_ptr<uint8_t>();
  a.w_row_bytes = w.size(1);
  a.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = w.size(0);
  a.format = f;
  a.out_dtype = float_dtype(out, "quant_gemm");
  return a;
}

// Which kernels quant_gemm may use: "auto" (AMX where it runs, else for int8 activations VNNI
// where it runs, else vpmaddubsw where the copy takes it by default (the avx2 copy; Q8_0 up to
// 128 rows), else strips; the AMX kernel's leftovers go to strips), "vnni" (VNNI where it
// runs, else strips), "maddubs" (the AVX2 integer kernel where the copy has AVX2, else
// strips), "strips" (the dequantize-and-GEMM path only, as on a CPU with none of them).
enum class GemmKernels { automatic, vnni, maddubs, strips };

GemmKernels kernels_named(const std::string& name) {
  if (name == "auto") return GemmKernels::automatic;
  if (name == "vnni") return GemmKernels::vnni;
  if (name == "maddubs") return GemmKernels::maddubs;
  if (name == "strips") return GemmKernels::strips;
  TORCH_CHECK(false, "quant_gemm: unknown kernels '", name,
              "'; allowed: auto, vnni, maddubs, strips");
}

}  // namespace

// The many-row path. Float activations in float32: strips of float32 weights, the float32
// GEMM. Int8 activations (any x) and bf16 x: the AMX kernel where it runs (x rounded through
// int8 first for int8 activations), else for int8 activations the VNNI kernel where it runs,
// else the AVX2 one (vpmaddubsw) on the avx2 copy (kernels/quant_maddubs.cpp says where it
// is the faster); else strips of dequantized weights through the dense GEMM (oneDNN) in bf16
// where the kernel copy in use multiplies bf16 natively, and in float32 where it does not
// (oneDNN's bf16 GEMM is 5-10x slower than its float32 one there); the result in x's dtype.
at::Tensor quant_gemm(at::Tensor x, at::Tensor w, const std::string& format,
                      const std::optional<at::Tensor>& bias, bool int8_activations,
                      int64_t strip_bytes, const std::string& kernels_name) {
  const QuantFormat f = format_of(format);
  const GemmKernels use = kernels_named(kernels_name);
  x = checked_x(x, "quant_gemm");
  w = checked_blocks(w, f, format, x.size(1), "quant_gemm");
  TORCH_CHECK(strip_bytes > 0, "quant_gemm: strip_bytes must be positive, got ", strip_bytes);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == w.size(0), "quant_gemm: bias has ", bias->numel(),
                " values for ", w.size(0), " outputs");
  }
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return out;
  const bool int8 = int8_activations && x.size(1) % 32 == 0;
  if (!int8 && x.scalar_type() == at::kFloat) {
    strips_gemm(x, w, f, bias, strip_bytes, out);
    return out;
  }
  if (use != GemmKernels::strips) {
    const auto bias32 = bias_as_float(bias, w.size(0), "quant_gemm");
    const QuantGemmArgs a = gemm_args(x, int8, w, f, bias32, out);
    // Where AMX runs, what it leaves (a prefill against a large weight) goes to oneDNN's
    // bf16 GEMM on AMX, far faster than integer dot products in vector registers.
    if (use == GemmKernels::automatic && kernels().amx_usable()) {
      if (kernels().quant_gemm_amx(a)) return out;
    } else if (int8 && use != GemmKernels::maddubs && kernels().quant_gemm_vnni(a)) {
      return out;
    } else if (int8 &&
               (use == GemmKernels::maddubs ||
                (use == GemmKernels::automatic && kernels().maddubs_auto(f, a.M))) &&
               kernels().quant_gemm_maddubs(a)) {
      return out;
    }
  }
  const auto dtype = kernels().bf16_dot ? at::kBFloat16 : at::kFloat;
  const auto xg = gemm_activations(x, int8, dtype);
  if (out.scalar_type() == dtype) {
    strips_gemm(xg, w, f, bias, strip_bytes, out);
    return out;
  }
  auto out_g = at::empty(out.sizes(), xg.options());
  strips_gemm(xg, w, f, std::nullopt, strip_bytes, out_g);
  if (bias.has_value() && bias->defined()) {
    at::add_out(out, out_g, bias->to(at::kFloat).reshape({w.size(0)}));
  } else {
    out.copy_(out_g);
  }
  return out;
}

namespace {

bool quant_amx_usable() { return kernels().amx_usable(); }
bool quant_vnni_usable() { return kernels().vnni_usable(); }
bool quant_maddubs_usable() { return kernels().maddubs_usable(); }

// x [M, K] as the many-row path's dense GEMM of `dtype` (bf16 or float32) takes it (tests).
at::Tensor quant_gemm_activations(at::Tensor x, bool int8_activations, at::ScalarType dtype) {
  x = checked_x(x, "quant_gemm_activations");
  TORCH_CHECK(!int8_activations || x.size(1) % 32 == 0, "quant_gemm_activations: ",
              x.size(1), " columns is not a multiple of 32");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "quant_gemm_activations: float32 or bfloat16 only, got ", dtype);
  return gemm_activations(x, int8_activations, dtype).clone();
}

}  // namespace

at::Tensor quant_linear(at::Tensor x, at::Tensor w, const std::string& format,
                        const std::optional<at::Tensor>& bias, bool int8_activations,
                        at::Tensor out) {
  const QuantFormat f = format_of(format);
  x = checked_x(x, "quant_linear");
  w = checked_blocks(w, f, format, x.size(1), "quant_linear");
  const auto bias32 = bias_as_float(bias, w.size(0), "quant_linear");
  out = out_or_empty(out, {x.size(0), w.size(0)}, x, "quant_linear");
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

at::Tensor quant_linear_parts(at::Tensor x, const std::vector<at::Tensor>& w,
                              const std::vector<std::string>& formats,
                              const std::optional<at::Tensor>& bias, at::Tensor out) {
  x = checked_x(x, "quant_linear");
  std::vector<at::Tensor> blocks;
  int64_t outputs = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    blocks.push_back(checked_blocks(w[i], format_of(formats[i]), formats[i], x.size(1),
                                    "quant_linear"));
    outputs += blocks.back().size(0);
  }
  const auto bias32 = bias_as_float(bias, outputs, "quant_linear");
  out = out_or_empty(out, {x.size(0), outputs}, x, "quant_linear");
  if (x.size(0) == 0 || outputs == 0) return out;
  std::vector<QuantLinearArgs> parts;
  int64_t row = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t rows = blocks[i].size(0);
    if (rows == 0) continue;
    QuantLinearArgs a{};
    a.x = x.data_ptr();
    a.x_stride = x.stride(0);
    a.w = blocks[i].data_ptr<uint8_t>();
    a.w_row_bytes = blocks[i].size(1);
    a.bias = bias32.defined() ? bias32.data_ptr<float>() + row : nullptr;
    a.out = static_cast<char*>(out.data_ptr()) + row * out.element_size();
    a.M = x.size(0);
    a.K = x.size(1);
    a.N = rows;
    a.format = format_of(formats[i]);
    a.dtype = float_dtype(x, "quant_linear");
    a.int8_activations = true;
    a.out_stride = outputs;
    parts.push_back(a);
    row += rows;
  }
  kernels().quant_linear_parts({parts.data(), static_cast<int64_t>(parts.size())});
  return out;
}

}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor w, str format, Tensor? bias, bool int8_activations) "
        "-> Tensor",
        [](at::Tensor x, at::Tensor w, const std::string& format,
           const std::optional<at::Tensor>& bias, bool int8_activations) {
          return plugserve::ops::quant_linear(std::move(x), std::move(w), format, bias,
                                              int8_activations);
        });
  m.def("quant_dequantize(Tensor w, str format, int cols, ScalarType dtype) -> Tensor",
        &plugserve::ops::quant_dequantize);
  m.def("quant_gemm(Tensor x, Tensor w, str format, Tensor? bias, bool int8_activations, "
        "int strip_bytes, str kernels) -> Tensor", &plugserve::ops::quant_gemm);
  m.def("quant_amx_usable() -> bool", &plugserve::ops::quant_amx_usable);
  m.def("quant_vnni_usable() -> bool", &plugserve::ops::quant_vnni_usable);
  m.def("quant_maddubs_usable() -> bool", &plugserve::ops::quant_maddubs_usable);
  m.def("quant_gemm_activations(Tensor x, bool int8_activations, ScalarType dtype) -> Tensor",
        &plugserve::ops::quant_gemm_activations);
}
