// The pieces of the many-row quantized linear that every ISA copy has (ops/quant_linear.cpp
// puts them together; quant_amx.cpp is the AMX kernel):
// - quant_dequantize: rows of GGML blocks widened to float32 or bf16 (quant_widen.h), each
//   thread a contiguous run of rows;
// - quant_activations: x as the bf16 GEMM multiplies it, rounded through int8 per 32-block
//   first for int8 activations, in one pass (the few-row kernel's rounding, quant_linear.cpp).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../vec/pvec.h"
#include "quant_blocks.h"
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

// One row of x: each 32-block rounded through int8 (as reference.quantize_activations_int8:
// divide by the float32 scale, round half to even, multiply by the scale rounded to fp16),
// then to bf16.
template <typename T>
void round_row_int8(const T* x, int64_t K, BF16* out) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    __m512 lo, hi;
    if constexpr (std::is_same_v<T, float>) {
      lo = _mm512_loadu_ps(x + k0);
      hi = _mm512_loadu_ps(x + k0 + 16);
    } else {
      const auto widen = [](const T* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      };
      lo = widen(x + k0);
      hi = widen(x + k0 + 16);
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.0f;
    const __m512 d = _mm512_set1_ps(round_to<Half>(scale));
    __m512 qlo = _mm512_setzero_ps(), qhi = _mm512_setzero_ps();
    if (scale > 0.0f) {  // divide (as the reference does), round half to even
      const __m512 s = _mm512_set1_ps(scale);
      constexpr int kEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      qlo = _mm512_roundscale_ps(_mm512_div_ps(lo, s), kEven);
      qhi = _mm512_roundscale_ps(_mm512_div_ps(hi, s), kEven);
    }
    qlo = _mm512_mul_ps(qlo, d);
    qhi = _mm512_mul_ps(qhi, d);
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(out + k0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(qhi, qlo)));
#else
    at::vec::convert_float_bfloat16(F(qlo), F(qhi)).store(out + k0);
#endif
  }
  return;
#endif
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    float v[kBlock];
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = to_float(x[k0 + i]);
      amax = std::max(amax, std::abs(v[i]));
    }
    const float scale = amax / 127.0f;
    const float d = round_to<Half>(scale);
    for (int i = 0; i < kBlock; ++i) {
      const float q = scale > 0.0f ? std::nearbyint(v[i] / scale) : 0.0f;
      out[k0 + i] = from_float<BF16>(q * d);
    }
  }
}

template <typename T>
void activations_typed(const QuantActivationsArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  BF16* out = static_cast<BF16*>(a.out);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(a.K, 1));
  at::parallel_for(0, a.M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * a.x_stride;
      if (a.int8) {
        round_row_int8(row, a.K, out + m * a.K);
      } else {
#pragma omp simd
        for (int64_t k = 0; k < a.K; ++k) out[m * a.K + k] = from_float<BF16>(to_float(row[k]));
      }
    }
  });
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
    activations_typed<float>(a);
  } else {
    TORCH_CHECK(a.dtype == Dtype::bf16, "quant_activations: float32 or bfloat16 x only");
    activations_typed<BF16>(a);
  }
}

PLUGSERVE_ISA_END
