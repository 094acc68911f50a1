// y = x @ w.T (+ bias) for a few rows of x: the decode step's linears, on the CPU.
//
// With one to a few dozen rows a linear layer is a stream over its weight: every weight
// element is used once per row. GEMM libraries tile for large products and, for 2..16 rows,
// reach a fraction of the memory bandwidth. Here each thread streams its own contiguous
// share of the weight rows exactly once, four rows at a time (prefetching the next four),
// and multiplies every block of them by all rows of x while it sits in registers and L1
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
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)

constexpr int64_t kRowsPerBlock = 4;  // weight rows streamed together
constexpr int64_t kXRows = 4;         // rows of x per register tile

// One tile: MR rows of x times kRowsPerBlock rows of w over all of K, plus bias, to out.
// The 16 accumulators are named variables, not an array: GCC keeps an array of vectors in
// memory and stores every accumulator on every iteration, which halves the FMA rate.
#define PLUGSERVE_ZERO4(i) \
  __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0;
#define PLUGSERVE_ROW4(i)                                                        \
  if constexpr (MR > i) {                                                        \
    const auto xv = Ops<T>::load(mask, x + i * x_stride + k);                    \
    a##i##0 = Ops<T>::madd(xv, w0, a##i##0);                                     \
    a##i##1 = Ops<T>::madd(xv, w1, a##i##1);                                     \
    a##i##2 = Ops<T>::madd(xv, w2, a##i##2);                                     \
    a##i##3 = Ops<T>::madd(xv, w3, a##i##3);                                     \
  }

// The element type's vector steps: `kStep` values of a row per vector, a masked load of the
// row tail, and acc += x * w summed into 16 float32 lanes.
template <typename T>
struct Ops;

template <>
struct Ops<float> {
  static constexpr int64_t kStep = 16;
  using Mask = __mmask16;
  static Mask tail(int64_t left) { return left >= 16 ? Mask(0xFFFF) : Mask((1u << left) - 1); }
  static __m512 load(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 madd(__m512 x, __m512 w, __m512 acc) { return _mm512_fmadd_ps(x, w, acc); }
  static float store(float y) { return y; }
};

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16 = true;
// bf16 values travel as their 16 bits (c10::BFloat16's storage).
template <>
struct Ops<uint16_t> {
  static constexpr int64_t kStep = 32;  // 16 pairs
  using Mask = __mmask32;
  static Mask tail(int64_t left) {
    return left >= 32 ? Mask(0xFFFFFFFFu) : Mask((uint32_t{1} << left) - 1);
  }
  static __m512bh load(Mask m, const uint16_t* p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
  }
  static __m512 madd(__m512bh x, __m512bh w, __m512 acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static uint16_t store(float y) { return c10::BFloat16(y).x; }  // round to nearest even
};
#else
constexpr bool kHaveBf16 = false;
#endif

template <typename T, int MR>
inline void tile(const T* __restrict x, const T* __restrict const* w_rows, int64_t K,
                 int64_t x_stride, const float* bias, int64_t n0, int64_t n_valid,
                 T* __restrict out, int64_t out_stride, int64_t next, bool prefetch) {
  static_assert(MR >= 1 && MR <= kXRows && kRowsPerBlock == 4, "tile shape");
  PLUGSERVE_ZERO4(0) PLUGSERVE_ZERO4(1) PLUGSERVE_ZERO4(2) PLUGSERVE_ZERO4(3)
  const T* r0 = w_rows[0]; const T* r1 = w_rows[1]; const T* r2 = w_rows[2];
  const T* r3 = w_rows[3];
  for (int64_t k = 0; k < K; k += Ops<T>::kStep) {
    const auto mask = Ops<T>::tail(K - k);
    const auto load = [mask](const T* p) { return Ops<T>::load(mask, p); };
    if (prefetch) {  // the next block's rows, one cache line each per step
      _mm_prefetch(reinterpret_cast<const char*>(r0 + next + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r1 + next + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r2 + next + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r3 + next + k), _MM_HINT_T0);
    }
    const auto w0 = load(r0 + k), w1 = load(r1 + k), w2 = load(r2 + k), w3 = load(r3 + k);
    PLUGSERVE_ROW4(0) PLUGSERVE_ROW4(1) PLUGSERVE_ROW4(2) PLUGSERVE_ROW4(3)
  }
  const float sums[kXRows][kRowsPerBlock] = {
      {_mm512_reduce_add_ps(a00), _mm512_reduce_add_ps(a01), _mm512_reduce_add_ps(a02), _mm512_reduce_add_ps(a03)},
      {_mm512_reduce_add_ps(a10), _mm512_reduce_add_ps(a11), _mm512_reduce_add_ps(a12), _mm512_reduce_add_ps(a13)},
      {_mm512_reduce_add_ps(a20), _mm512_reduce_add_ps(a21), _mm512_reduce_add_ps(a22), _mm512_reduce_add_ps(a23)},
      {_mm512_reduce_add_ps(a30), _mm512_reduce_add_ps(a31), _mm512_reduce_add_ps(a32), _mm512_reduce_add_ps(a33)},
  };
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < n_valid; ++j) {
      const float y = bias != nullptr ? sums[i][j] + bias[n0 + j] : sums[i][j];
      out[i * out_stride + n0 + j] = Ops<T>::store(y);
    }
  }
}
#undef PLUGSERVE_ROW4
#undef PLUGSERVE_ZERO4

template <typename T>
void run(const T* x_ptr, const T* w_ptr, const float* bias, T* out_ptr, int64_t M, int64_t K,
         int64_t N) {
  const int64_t blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  // A thread's share is a contiguous run of weight rows: one sequential stream each.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock;
      const int64_t n_valid = std::min(kRowsPerBlock, N - n0);
      const T* w_rows[kRowsPerBlock];
      for (int64_t j = 0; j < kRowsPerBlock; ++j)
        w_rows[j] = w_ptr + std::min(n0 + j, N - 1) * K;  // past N: re-read the last row
      // The next block's rows lie kRowsPerBlock * K floats further on; fetch them while this
      // block computes (on its first tile of x rows only, and not past this thread's share).
      const int64_t next = kRowsPerBlock * K;
      bool prefetch = b + 1 < end;
      int64_t m0 = 0;
      for (; m0 + kXRows <= M; m0 += kXRows, prefetch = false)
        tile<T, kXRows>(x_ptr + m0 * K, w_rows, K, K, bias, n0, n_valid, out_ptr + m0 * N, N, next, prefetch);
      const T* xr = x_ptr + m0 * K;
      T* o = out_ptr + m0 * N;
      switch (M - m0) {
        case 3: tile<T, 3>(xr, w_rows, K, K, bias, n0, n_valid, o, N, next, prefetch); break;
        case 2: tile<T, 2>(xr, w_rows, K, K, bias, n0, n_valid, o, N, next, prefetch); break;
        case 1: tile<T, 1>(xr, w_rows, K, K, bias, n0, n_valid, o, N, next, prefetch); break;
        default: break;
      }
    }
  });
}

#else
constexpr bool kHaveBf16 = false;
#endif  // __AVX512F__

}  // namespace

std::string isa() {
#if defined(__AVX512F__)
  return kHaveBf16 ? "avx512_bf16" : "avx512";
#else
  return "none";
#endif
}

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
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == w.size(0), "skinny_linear: bias has ", bias->numel(),
                " values for ", w.size(0), " outputs");
    bias32 = bias->to(torch::kFloat).contiguous();
  }
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
#if defined(__AVX512F__)
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (dtype == torch::kFloat) {
    run(x.data_ptr<float>(), w.data_ptr<float>(), bias_ptr, out.data_ptr<float>(), M, K, N);
  } else {
#if defined(__AVX512BF16__)
    const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run<uint16_t>(bits(x), bits(w), bias_ptr, bits(out), M, K, N);
#endif
  }
#else
  TORCH_CHECK(false, "skinny_linear: built without AVX-512 (isa() == \"none\")");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set this build uses: avx512_bf16, avx512 or none");
  m.def("has_bf16", &has_bf16, "whether bfloat16 operands are taken (AVX512-BF16)");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for few rows of x (CPU)");
}
