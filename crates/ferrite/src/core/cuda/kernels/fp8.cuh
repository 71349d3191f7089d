// fp8.cuh — the two FP8 formats on the device (core/fp8.rs documents them): exact decoding to
// float in integer arithmetic, on any architecture. Expanded into a module by the JIT.
#ifndef FERRITE_FP8_CUH
#define FERRITE_FP8_CUH

#include "ferrite.cuh"

namespace ferrite {

// The value of an e4m3 code (bias 7, no Inf, S.1111.111 NaN).
__device__ __forceinline__ float fp8_e4m3_to_float(unsigned char c) {
  const unsigned s = (c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
  if (e == 15u && m == 7u) return __int_as_float(0x7fc00000);
  // Subnormal m·2⁻⁹ (exact in float); normal: the exponent re-biased to 127.
  const float v = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return __uint_as_float(__float_as_uint(v) | s);
}

// The value of an e5m2 code (bias 15, IEEE Inf and NaN).
__device__ __forceinline__ float fp8_e5m2_to_float(unsigned char c) {
  const unsigned s = (c & 0x80u) << 24, e = (c >> 2) & 31u, m = c & 3u;
  float v;
  if (e == 31u)
    v = m ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
  else
    v = e == 0u ? (float)m * 1.52587890625e-05f : __uint_as_float(((e + 112u) << 23) | (m << 21));
  return __uint_as_float(__float_as_uint(v) | s);
}

template <bool E5M2>
__device__ __forceinline__ float fp8_to_float(unsigned char c) {
  return E5M2 ? fp8_e5m2_to_float(c) : fp8_e4m3_to_float(c);
}

}  // namespace ferrite

#endif  // FERRITE_FP8_CUH
