// The streaming few-row linear y = x @ w.T (+ bias): see skinny_linear.cpp, whose Python
// module calls it on its own, and decode_layer.cpp, which chains it with the elementwise steps.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace plugserve::skinny {

#if defined(__AVX512F__)

constexpr int64_t kRowsPerBlock = 4;  // weight rows streamed together
constexpr int64_t kXRows = 4;         // rows of x per register tile
// How far ahead of its loads each weight row is fetched, into L2. The hardware prefetchers
// alone leave a single-row stream at ~70% of a plain read's bandwidth (bf16: ~23 of
// ~30 GB/s on two cores); 8 KiB ahead covers the DRAM latency at this loop's speed and
// brings it level (bf16 ~34, fp32 ~32 GB/s, measured over the decoder's matrices). Into
// L1 (prefetcht0) instead is slower than not prefetching: the lines evict ones still in use.
constexpr int64_t kPrefetchBytes = 8192;

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
                 T* __restrict out, int64_t out_stride, const char* prefetch_stop) {
  static_assert(MR >= 1 && MR <= kXRows && kRowsPerBlock == 4, "tile shape");
  PLUGSERVE_ZERO4(0) PLUGSERVE_ZERO4(1) PLUGSERVE_ZERO4(2) PLUGSERVE_ZERO4(3)
  const T* r0 = w_rows[0]; const T* r1 = w_rows[1]; const T* r2 = w_rows[2];
  const T* r3 = w_rows[3];
  for (int64_t k = 0; k < K; k += Ops<T>::kStep) {
    const auto mask = Ops<T>::tail(K - k);
    const auto load = [mask](const T* p) { return Ops<T>::load(mask, p); };
    if (prefetch_stop != nullptr) {  // each row's line kPrefetchBytes on, within the share
      for (const T* r : {r0, r1, r2, r3}) {
        const char* ahead = reinterpret_cast<const char*>(r + k) + kPrefetchBytes;
        if (ahead < prefetch_stop) _mm_prefetch(ahead, _MM_HINT_T1);
      }
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
    const T* const share_end_row = w_ptr + std::min(end * kRowsPerBlock, N) * K;
    const char* share_end = reinterpret_cast<const char*>(share_end_row);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRowsPerBlock;
      const int64_t n_valid = std::min(kRowsPerBlock, N - n0);
      const T* w_rows[kRowsPerBlock];
      for (int64_t j = 0; j < kRowsPerBlock; ++j)
        w_rows[j] = w_ptr + std::min(n0 + j, N - 1) * K;  // past N: re-read the last row
      // The stream ahead is fetched on the block's first tile of x rows only (the later ones
      // find the block in cache), and not past this thread's share.
      const char* prefetch = share_end;
      int64_t m0 = 0;
      for (; m0 + kXRows <= M; m0 += kXRows, prefetch = nullptr)
        tile<T, kXRows>(x_ptr + m0 * K, w_rows, K, K, bias, n0, n_valid, out_ptr + m0 * N, N,
                        prefetch);
      const T* xr = x_ptr + m0 * K;
      T* o = out_ptr + m0 * N;
      switch (M - m0) {
        case 3: tile<T, 3>(xr, w_rows, K, K, bias, n0, n_valid, o, N, prefetch); break;
        case 2: tile<T, 2>(xr, w_rows, K, K, bias, n0, n_valid, o, N, prefetch); break;
        case 1: tile<T, 1>(xr, w_rows, K, K, bias, n0, n_valid, o, N, prefetch); break;
        default: break;
      }
    }
  });
}

#else
constexpr bool kHaveBf16 = false;
#endif  // __AVX512F__


// out [M, N] = x [M, K] @ w [N, K].T + bias, all contiguous; x, w and out of one dtype
// (float32, or bfloat16 where kHaveBf16); bias32 float32 [N] or undefined. The callers check.
inline void linear_into(const torch::Tensor& x, const torch::Tensor& w,
                        const torch::Tensor& bias32, torch::Tensor& out) {
#if defined(__AVX512F__)
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (x.scalar_type() == torch::kFloat) {
    run(x.data_ptr<float>(), w.data_ptr<float>(), bias_ptr, out.data_ptr<float>(), M, K, N);
  } else {
#if defined(__AVX512BF16__)
    const auto bits = [](const torch::Tensor& t) {
      return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    run<uint16_t>(bits(x), bits(w), bias_ptr, bits(out), M, K, N);
#endif
  }
#else
  TORCH_CHECK(false, "skinny_linear: built without AVX-512 (isa() == \"none\")");
#endif
}

// The bias as the kernel adds it: float32, or undefined for none.
inline torch::Tensor bias_as_float(const c10::optional<torch::Tensor>& bias, int64_t outputs,
                                   const char* what) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == outputs, what, ": bias has ", bias->numel(), " values for ",
              outputs, " outputs");
  return bias->to(torch::kFloat).contiguous();
}

// The vector code this build has: "avx512_bf16", "avx512", or "none" (no kernel here).
inline std::string isa() {
#if defined(__AVX512F__)
  return kHaveBf16 ? "avx512_bf16" : "avx512";
#else
  return "none";
#endif
}

}  // namespace plugserve::skinny
