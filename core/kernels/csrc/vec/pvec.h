// The portable vector layer the kernels in csrc/kernels/ are written in, once for every ISA.
//
// A kernel source is compiled once per ISA (core/kernels/isa.py) with that ISA's compiler
// flags and macros: PLUGSERVE_ISA names the copy (scalar, avx2, avx512, avx512_bf16, neon,
// sve256) and CPU_CAPABILITY_<X> selects ATen's implementation of `at::vec::Vectorized<T>`
// (the layer PyTorch's own CPU kernels use). Everything a kernel defines lives in namespace
// plugserve::PLUGSERVE_ISA (open it with PLUGSERVE_ISA_BEGIN / _END after the includes), so
// the copies never share a function: a helper compiled with AVX-512 instructions can never
// be picked for the AVX2 copy.
//
// What this adds to ATen's layer:
//   F, kWidth            Vectorized<float> and its lanes (16 on AVX-512, 8 on AVX2 and in
//                        the scalar copy, where ATen's generic code is plain loops)
//   load / load_n        kWidth values of float, bf16 (a 16-bit shift) or fp16 as float32;
//                        load_n reads n < kWidth of them and zeros the rest
//   store / store_n      float32 lanes rounded to the element type (round to nearest even)
//   exp, exp2            e^x / 2^x over the float range, within a few ulp (no libm calls)
//   prefetch_l1 / _l2    software prefetch (a no-op where the compiler has none);
//   prefetch_far         the same with the lowest locality hint (x86: prefetcht2)
//   prefetch_stream      a streamed weight's lines ahead of use: L1 on Intel, else L2
//   to_float, from_float scalar conversions that vectorise in plain loops
//   kBf16Dot             true in the avx512_bf16 copy: kernels may use vdpbf16ps there
// ISA-specific fast paths go inside `#if defined(__AVX512BF16__)` (etc.) blocks next to the
// portable code, which stays the reference for every other ISA.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../kernel_api.h"

#ifndef PLUGSERVE_ISA
#error "compile kernel sources through plugserve.kernels.build (PLUGSERVE_ISA names the copy)"
#endif

#define PLUGSERVE_ISA_BEGIN namespace plugserve { namespace PLUGSERVE_ISA {
#define PLUGSERVE_ISA_END } }

PLUGSERVE_ISA_BEGIN
namespace vec {

using BF16 = c10::BFloat16;
using Half = c10::Half;
using F = at::vec::Vectorized<float>;
using I32 = at::vec::Vectorized<int32_t>;
constexpr int64_t kWidth = F::size();
// A register of F as a plain vector type where there is one: register tiles hold their
// accumulators as arrays of Reg, which GCC keeps in registers (an array of Vectorized
// objects it keeps in memory, storing every accumulator on every iteration).
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
#else
using Reg = F;
#endif
inline Reg fmadd(const F& a, const F& b, const F& c) { return at::vec::fmadd(a, b, c); }

// Registers of F the ISA has (tiles are sized to fit them with room for operands).
constexpr int kRegisters = sizeof(F) >= 64 ? 32 : (sizeof(F) == 32 ? 16 : 32);

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// ---- scalar conversions (loops over these vectorise) ------------------------------------
inline float to_float(float v) { return v; }
inline float to_float(BF16 v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16);
}
#ifdef __FLT16_MAX__  // the compiler's own IEEE half type: conversions it vectorises (F16C)
inline float to_float(Half v) { return static_cast<float>(__builtin_bit_cast(_Float16, v.x)); }
#else
inline float to_float(Half v) { return static_cast<float>(v); }
#endif

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline BF16 from_float<BF16>(float v) {
  // Round to nearest even, NaN to the canonical quiet NaN: c10's conversion, branch-free.
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = v != v ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return BF16(out, BF16::from_bits());
}
#ifdef __FLT16_MAX__
template <>
inline Half from_float<Half>(float v) {
  return Half(__builtin_bit_cast(uint16_t, static_cast<_Float16>(v)), Half::from_bits());
}
#else
template <>
inline Half from_float<Half>(float v) { return Half(v); }
#endif

// v rounded to T and widened back: what a torch op with a T output hands to the next op.
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

// ---- vector loads and stores ------------------------------------------------------------
inline F load(const float* p) { return F::loadu(p); }
inline F load(const BF16* p) {
  F out;
  at::vec::load_to_float(p, out);
  return out;
}
inline F load(const Half* p) {
  F out;
  at::vec::load_to_float(p, out);
  return out;
}

// n (< kWidth) values, the other lanes zero.
template <typename T>
inline F load_n(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return F::loadu(p, n);
  } else {
    T buf[kWidth];
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
    return load(buf);
  }
}

inline void store(float* p, F v) { v.store(p); }
template <typename T>
inline void store(T* p, F v) {
  __at_align__ float tmp[kWidth];
  v.store(tmp);
#pragma omp simd
  for (int64_t i = 0; i < kWidth; ++i) p[i] = from_float<T>(tmp[i]);
}
template <typename T>
inline void store_n(T* p, F v, int64_t n) {
  __at_align__ float tmp[kWidth];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i] = from_float<T>(tmp[i]);
}

#if defined(__AVX512BF16__)
// bf16 roundings in one instruction each (vcvtneps2bf16: to nearest even, as c10's
// conversion, except that a subnormal value becomes zero and a NaN's payload may differ).
inline F widen_bf16(__m256bh v) {
  return F(_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(v)), 16)));
}
inline F round_bf16(F v) { return widen_bf16(_mm512_cvtneps_pbh(v)); }
inline void store_bf16(BF16* p, F v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// Horizontal sum and max (ATen's generic reduce_add does not compile in the scalar copy).
inline float hsum(F v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](const F& a, const F& b) { return a + b; }, v);
#endif
}
inline float hmax(F v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  return at::vec::vec_reduce_all<float>(
      [](const F& a, const F& b) { return at::vec::maximum(a, b); }, v);
#endif
}

// ---- prefetch ---------------------------------------------------------------------------
// Every prefetch goes through these three. GCC counts __builtin_prefetch as no effect at all:
// a function whose only work is prefetching is taken for `pure`, and a call to it whose
// (void) result is unused is deleted wherever the function was not inlined first. That
// happened to a small helper (the bf16 pair walk's, split in two by GCC's function splitting:
// the avx2 copy's bf16 batch-1 decode had no prefetch at all, and the AMX strips lost theirs).
// The empty asm statement, volatile, is an effect GCC must keep, so no caller loses a prefetch
// to that analysis; it emits no instruction. (Clang gives prefetches an effect of their own.)
template <int kLocality>  // __builtin_prefetch's hint: 3 = L1, 2 = L2, 1 = the lowest
inline void prefetch_kept(const void* p) {
  __builtin_prefetch(p, 0, kLocality);
  asm volatile("" : : "r"(p));
}
inline void prefetch_l2(const void* p) { prefetch_kept<2>(p); }
inline void prefetch_l1(const void* p) { prefetch_kept<3>(p); }
inline void prefetch_far(const void* p) { prefetch_kept<1>(p); }

// A dense weight stream read once, asked for a few KiB ahead of its loads (skinny_linear.cpp):
// into L1 on Intel CPUs, into L2 on the others. Measured on two Cascade Lake cores (batch-1
// decode of SmolLM2-135M, alternated runs, best step of three 128-token runs): into L1 the
// float32 step 29.3-30.0 -> 28.0-28.4 ms, bf16 (with the one-row walk there) 16.5-19.1 ->
// 15.4-15.8; on two Zen 4 cores L1 was the slower choice (the lines evicted ones in use), so
// the others keep L2. The quantized kernels' streams (more work per byte) moved by less than
// the noise into L1 and keep L2. Decided once per process.
#if defined(__x86_64__) || defined(__i386__)
inline const bool kStreamIntoL1 = [] {
  __builtin_cpu_init();  // may run before the runtime's own detection (a static initializer)
  return __builtin_cpu_is("intel") != 0;
}();
#else
inline constexpr bool kStreamIntoL1 = false;
#endif
inline void prefetch_stream(const void* p) {
  if (kStreamIntoL1) {
    prefetch_l1(p);
  } else {
    prefetch_l2(p);
  }
}

// ---- exp --------------------------------------------------------------------------------
// 2^k as float for integer-valued k in [-126, 127] (a float built from its exponent bits).
inline F pow2i(F k) {
  const I32 bits = at::vec::convert_to_int_of_same_size(k) + I32(127);
  return at::vec::cast<float>(bits << I32(23));
}

// e^x over the whole float range, within an ulp or two of expf: 2^n * e^r with
// r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts) and the degree-7 polynomial of Cephes'
// expf for e^r. 2^n is applied as two factors so that results near overflow (n = 128) and in
// the subnormal range (n down to -150) come out right. NaN stays NaN.
inline F exp(F x) {
  x = at::vec::minimum(at::vec::maximum(x, F(-104.0f)), F(88.8f));
  const F n = (x * F(1.44269504088896341f)).round();
  const F r = (x - n * F(0.693359375f)) + n * F(2.12194440e-4f);
  F p(1.9875691500e-4f);
  p = at::vec::fmadd(p, r, F(1.3981999507e-3f));
  p = at::vec::fmadd(p, r, F(8.3334519073e-3f));
  p = at::vec::fmadd(p, r, F(4.1665795894e-2f));
  p = at::vec::fmadd(p, r, F(1.6666665459e-1f));
  p = at::vec::fmadd(p, r, F(5.0000001201e-1f));
  p = at::vec::fmadd(p * r, r, r + F(1.0f));
  const F half = (n * F(0.5f)).floor();  // n = half + (n - half), both within exponent range
  return p * pow2i(half) * pow2i(n - half);
}

// 2^t within 2e-7 relative (Cephes' exp2f polynomial on [-1/2, 1/2]); 0 below 2^-126.
inline F exp2(F t) {
#if defined(CPU_CAPABILITY_AVX512)
  // vscalefps applies 2^n without building exponent bits, and gives 0 for very negative t.
  const F n(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  const F clamped = at::vec::minimum(at::vec::maximum(t, F(-127.0f)), F(127.0f));
  const F n = clamped.round();
  t = clamped;
#endif
  const F f = t - n;
  F y(1.535336188319500e-4f);
  y = at::vec::fmadd(y, f, F(1.339887440266574e-3f));
  y = at::vec::fmadd(y, f, F(9.618437357674640e-3f));
  y = at::vec::fmadd(y, f, F(5.550332471162809e-2f));
  y = at::vec::fmadd(y, f, F(2.402264791363012e-1f));
  y = at::vec::fmadd(y, f, F(6.931472028550421e-1f));
  y = at::vec::fmadd(y, f, F(1.0f));
#if defined(CPU_CAPABILITY_AVX512)
  return F(_mm512_scalef_ps(y, n));
#else
  // n = -127 would build a zero exponent: those lanes (t < -126.5) are below the range.
  const F scaled = y * pow2i(at::vec::maximum(n, F(-126.0f)));
  return F::blendv(scaled, F(0.0f), n < F(-126.0f));
#endif
}

// max(a, b) in one instruction where there is one, for operands that are not NaN.
inline F max_no_nan(const F& a, const F& b) { return at::vec::clamp_min(a, b); }

// The scalar e^x of `exp` (for the odd tail element and for plain loops).
inline float exp_f32(float x) {
  x = std::min(std::max(x, -104.0f), 88.8f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t k = static_cast<int32_t>(n);
  const int32_t k1 = k >> 1, k2 = k - k1;
  const float s1 = __builtin_bit_cast(float, static_cast<uint32_t>(k1 + 127) << 23);
  const float s2 = __builtin_bit_cast(float, static_cast<uint32_t>(k2 + 127) << 23);
  return p * s1 * s2;
}

// Dispatch a templated call on a Dtype: T is float, BF16 or Half inside `__VA_ARGS__`.
#define PLUGSERVE_FLOAT_TYPES(dtype, what, ...)                                         \
  switch (dtype) {                                                                      \
    case ::plugserve::Dtype::f32: { using T = float; __VA_ARGS__; break; }              \
    case ::plugserve::Dtype::bf16: { using T = ::c10::BFloat16; __VA_ARGS__; break; }   \
    case ::plugserve::Dtype::f16: { using T = ::c10::Half; __VA_ARGS__; break; }        \
    default: TORCH_CHECK(false, what, ": unsupported element type");                    \
  }

}  // namespace vec
PLUGSERVE_ISA_END
