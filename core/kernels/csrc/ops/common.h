// Shared by the ops (csrc/ops/*.cpp): the torch-facing side of the kernels. An op checks its
// tensors, allocates the outputs, fills the kernel's argument struct and calls the kernel of
// the ISA in use (`kernels().name(args)`). Compiled once, with the baseline flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "../dispatch.h"

namespace plugserve::ops {

// The kernels' element type for a float tensor (float32, bfloat16, float16).
inline Dtype float_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dtype::f32;
    case at::kBFloat16: return Dtype::bf16;
    case at::kHalf: return Dtype::f16;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type(),
                         " (float32, bfloat16 or float16)");
  }
}

// The element type of a KV cache buffer: a float dtype, or an fp8 format.
inline Dtype kv_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat8_e4m3fn: return Dtype::f8e4m3;
    case at::kFloat8_e5m2: return Dtype::f8e5m2;
    default: return float_dtype(t, what);
  }
}

// Row starts of `t` for every dim but the last (which must be contiguous).
inline RowLayout row_layout(const at::Tensor& t) {
  RowLayout layout;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (layout.dims > 0 && layout.strides[layout.dims - 1] == stride * size) {
      layout.sizes[layout.dims - 1] *= size;
      layout.strides[layout.dims - 1] = stride;
    } else {
      TORCH_CHECK(layout.dims < RowLayout::kMaxDims, "too many dims: ", t.sizes());
      layout.sizes[layout.dims] = size;
      layout.strides[layout.dims] = stride;
      ++layout.dims;
    }
  }
  return layout;
}

inline int64_t rows_of(const at::Tensor& t) {
  const int64_t last = t.size(-1);
  return last == 0 ? 0 : t.numel() / last;
}

inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The bias as the linear kernels add it: float32, or undefined for none.
inline at::Tensor bias_as_float(const std::optional<at::Tensor>& bias, int64_t outputs,
                                const char* what) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == outputs, what, ": bias has ", bias->numel(), " values for ",
              outputs, " outputs");
  return bias->to(at::kFloat).contiguous();
}

// Bytes of weight per strip where an op widens or dequantizes a weight into its GEMM's dtype
// before multiplying (quant_gemm's dequantize-and-GEMM path, widening_gemm's many rows): up to
// this much, the whole matrix (plugserve.kernels.quant_linear.STRIP_BYTES on the Python side).
constexpr int64_t kWeightStripBytes = int64_t{8} << 20;

// out [M, N] = x [M, K] @ W.T (+ b, x's dtype) for a weight W [N, K] made strip by strip:
// strips of whole rows in x's dtype, up to strip_bytes each (a multiple of 16 rows, at least
// 16), each written by fill(n0, rows, strip) into one reused buffer and multiplied by the
// dense GEMM straight into out's columns n0.. (a strided column block of out).
template <typename Fill>
void gemm_by_weight_strips(const at::Tensor& x, int64_t N, const at::Tensor& b,
                           int64_t strip_bytes, at::Tensor& out, const Fill& fill) {
  const int64_t row_bytes = std::max<int64_t>(1, x.size(1) * x.element_size());
  const int64_t strip = std::min(std::max<int64_t>(16, strip_bytes / row_bytes / 16 * 16), N);
  auto buffer = at::empty({strip, x.size(1)}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += strip) {
    const int64_t rows = std::min(strip, N - n0);
    auto ws = buffer.narrow(0, 0, rows);
    fill(n0, rows, ws);
    auto os = out.narrow(1, n0, rows);
    if (b.defined()) {
      at::addmm_out(os, b.narrow(0, n0, rows), x, ws.t());
    } else {
      at::mm_out(os, x, ws.t());
    }
  }
}

// out [M, N] = x [M, K] @ w [N, K].T + bias32 with the few-row kernel (ops/linear.cpp).
void skinny_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias32,
                        at::Tensor& out);

// out [M, N] = x [M, K] @ dequantize(w).T (+ bias) with the few-row kernel over GGML blocks
// of `format` (q8_0, q4_0, ...; ops/quant_linear.cpp), x float32 or bfloat16.
// `out`: where to write, a contiguous [M, N] tensor of x's dtype (undefined: a new one).
at::Tensor quant_linear(at::Tensor x, at::Tensor w, const std::string& format,
                        const std::optional<at::Tensor>& bias, bool int8_activations,
                        at::Tensor out = {});
// The same for weights w[i] of formats[i] sharing x, stacked along the outputs (one [M, sum
// of their rows] output, one bias for all), with int8 activations: x rounded once, one pass.
at::Tensor quant_linear_parts(at::Tensor x, const std::vector<at::Tensor>& w,
                              const std::vector<std::string>& formats,
                              const std::optional<at::Tensor>& bias, at::Tensor out = {});

// The many-row path over GGML blocks (ops/quant_linear.cpp; plugserve.kernels.quant_linear
// calls it past MAX_FEW_ROWS rows): the AMX kernel, else for int8 activations the VNNI one or
// the AVX2 one, where they run and `kernels` ("auto", "vnni", "maddubs", "strips") allows
// them, else strips of up to strip_bytes of dequantized weight through oneDNN; the result in
// x's dtype.
at::Tensor quant_gemm(at::Tensor x, at::Tensor w, const std::string& format,
                      const std::optional<at::Tensor>& bias, bool int8_activations,
                      int64_t strip_bytes, const std::string& kernels);

// The batch linears against their packed weights (ops/dense_amx.cpp, ops/linear.cpp):
// x [M, K] bf16 @ w.T (+ bias) on AMX tiles, w packed by plugserve.kernels.dense_amx.pack;
// x [M, K] float32 @ w.T (+ bias) by the panel GEMM, w packed by panel_gemm_pack.
at::Tensor dense_amx_linear(at::Tensor x, const at::Tensor& w_packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias);
at::Tensor panel_gemm(at::Tensor x, const at::Tensor& packed, int64_t N,
                      std::optional<at::Tensor> bias);

// The elementwise kernels on tensors the caller checked (ops/elementwise.cpp).
void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset,
                   at::Tensor& out);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                       double eps, bool unit_offset, at::Tensor& out, at::Tensor& new_residual);
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);
void rope_in_place(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Decode attention over a paged cache (ops/attention.cpp); `out` as for quant_linear (q's
// shape).
at::Tensor paged_decode(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& slots, at::Tensor first_key, at::Tensor kv_lens,
                        double scale, double k_scale, double v_scale, at::Tensor out = {});

// `out` if it is defined (checked to be a contiguous tensor of `sizes` and `like`'s dtype),
// else a new one: the ops that write into a caller's buffer.
inline at::Tensor out_or_empty(const at::Tensor& out, at::IntArrayRef sizes,
                               const at::Tensor& like, const char* what) {
  if (!out.defined()) return at::empty(sizes, like.options());
  TORCH_CHECK(out.sizes() == sizes && out.scalar_type() == like.scalar_type() &&
                  out.is_contiguous() && out.device() == like.device(),
              what, ": the output must be a contiguous ", sizes, " tensor of ",
              like.scalar_type(), ", got ", out.sizes(), " of ", out.scalar_type());
  return out;
}

// buffer[slots[r]] = rows[r] (converted to the buffer's dtype, / scale for fp8).
void store_rows(at::Tensor& buffer, const at::Tensor& slots, const at::Tensor& rows,
                double scale);

}  // namespace plugserve::ops
