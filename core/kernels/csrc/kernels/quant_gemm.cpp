// The pieces of the many-row quantized linear that every ISA copy has (ops/quant_linear.cpp
// puts them together; quant_amx.cpp is the AMX kernel):
// - quant_dequantize: rows of GGML blocks widened to float32 or bf16 (quant_widen.h), each
//   thread a contiguous run of rows;
// - quant_activations: x as the dense GEMM multiplies it (bf16, or float32 where the copy in
//   use has no native bf16 product), rounded through int8 per 32-block first for int8
//   activations, in one pass (the few-row kernel's rounding, quant_linear.cpp).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../vec/pvec.h"
#include "quant_blocks.h"
#include "quant_row_bf16.h"
#include "quant_widen.h"

PLUGSERVE_ISA_BEGIN
namespace {

using namespace vec;
using quant::kBlock;

template <QuantFormat Fmt, typename TO>
void dequantize_rows(const QuantDequantizeArgs& a) {
  TO* out = static_cast<TO*>(a.out);
  // A few rows per task at least: a task is worth its scheduling.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(a.K, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quant::widen_row<Fmt, TO>(a.w + r * a.w_row_bytes, a.K, out + r * a.K);
  });
}

template <typename T, typename O>
void activations_typed(const QuantActivationsArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  O* out = static_cast<O*>(a.out);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(a.K, 1));
  at::parallel_for(0, a.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * a.x_stride;
      quant::row_as(row, a.K, a.int8, out + m * a.K);
    }
  });
}

template <typename T>
void activations_into(const QuantActivationsArgs& a) {
  if (a.out_dtype == Dtype::f32) {
    activations_typed<T, float>(a);
  } else {
    TORCH_CHECK(a.out_dtype == Dtype::bf16, "quant_activations: float32 or bfloat16 out only");
    activations_typed<T, BF16>(a);
  }
}

}  // namespace

void quant_dequantize(const QuantDequantizeArgs& a) {
  quant::with_format(a.format, [&](auto fmt) {
    constexpr QuantFormat Fmt = decltype(fmt)::value;
    if (a.dtype == Dtype::f32) {
      dequantize_rows<Fmt, float>(a);
    } else {
      TORCH_CHECK(a.dtype == Dtype::bf16, "quant_dequantize: float32 or bfloat16 output only");
      dequantize_rows<Fmt, BF16>(a);
    }
  });
}

void quant_activations(const QuantActivationsArgs& a) {
  TORCH_CHECK(!a.int8 || a.K % kBlock == 0, "quant_activations: ", a.K,
              " columns is not a multiple of 32");
  if (a.dtype == Dtype::f32) {
    activations_into<float>(a);
  } else {
    TORCH_CHECK(a.dtype == Dtype::bf16, "quant_activations: float32 or bfloat16 x only");
    activations_into<BF16>(a);
  }
}

PLUGSERVE_ISA_END
