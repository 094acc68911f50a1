// y = x @ w.T (+ bias) for a few rows of x: the decode step's linears, on the CPU.
//
// With one to a few dozen rows a linear layer is a stream over its weight: every weight
// element is used once per row. GEMM libraries tile for large products and, for 2..16 rows,
// reach a fraction of the memory bandwidth. Here each thread streams its own contiguous
// share of the weight rows exactly once, four rows at a time (prefetching 8 KiB ahead into
// L2), and multiplies every block of them by all rows of x while it sits in registers and L1
// (x itself is small and stays in cache).
//
// float32: products and sums are float32 FMAs. bfloat16 (CPUs with AVX512-BF16): vdpbf16ps
// multiplies pairs of bf16 values exactly and sums them in float32, as oneDNN's bf16 matmul
// does; the float32 sum plus the bias is rounded to bf16 once, at the end. For bf16 the
// Python side uses this only for one or two rows: there it saves oneDNN's fixed cost per
// call (~15 us, a third of a small layer's time); with more rows oneDNN is as fast or faster.
//
// Built for the CPU it runs on (-march=native). Without AVX-512 there is no kernel here:
// `isa()` says "none" and the Python side keeps its GEMM-library path.
#include <torch/extension.h>

#include <string>

#include "skinny_linear.h"

using plugserve::skinny::bias_as_float;
using plugserve::skinny::kHaveBf16;
using plugserve::skinny::linear_into;

bool has_bf16() { return kHaveBf16; }

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x and w must be 2-d");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x has ", x.size(1),
              " columns, w has ", w.size(1));
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == w.scalar_type() &&
                  (dtype == torch::kFloat || (kHaveBf16 && dtype == torch::kBFloat16)),
              "skinny_linear: x and w must both be float32", kHaveBf16 ? " or bfloat16" : "",
              " here, got ", x.scalar_type(), " and ", w.scalar_type());
  x = x.contiguous();
  w = w.contiguous();
  const auto bias32 = bias_as_float(bias, w.size(0), "skinny_linear");
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_into(x, w, bias32, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &plugserve::skinny::isa,
        "the instruction set this build uses: avx512_bf16, avx512 or none");
  m.def("has_bf16", &has_bf16, "whether bfloat16 operands are taken (AVX512-BF16)");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for few rows of x (CPU)");
}
