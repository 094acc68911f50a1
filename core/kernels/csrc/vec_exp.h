// Shared by the CPU kernels in this folder. (plugserve/kernels/build.py hashes the headers
// here into every build's flags, so a change to one rebuilds the kernels that include it.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace plugserve {

// e^x over the whole float range, within an ulp or two of expf, in a form the compiler
// vectorises: 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts) and the
// degree-7 polynomial of Cephes' expf for e^r. 2^n is applied as two factors so that results
// near overflow (n = 128) and in the subnormal range (n down to -150) come out right.
inline float exp_f32(float x) {
  x = std::min(std::max(x, -104.0f), 88.8f);  // beyond: 0 and inf anyway (NaN stays NaN)
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

}  // namespace plugserve
