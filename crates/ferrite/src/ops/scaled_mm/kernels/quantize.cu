// scaled_mm/quantize — FP8 quantisation with current or given scales: the step before a scaled
// GEMM. Two passes over x [rows][cols] (rows contiguous):
//   fp8_amax:     amax = max |x| per row, or over the tensor (atomicMax on the float's bits, into
//                 an amax the host zeroed), NaN-propagating: a NaN anywhere makes its amax NaN.
//   fp8_quantize: q = satfinite_rn(x · s) per element, s the given scale or FMAX / amax (current
//                 scaling: the largest |x| lands on the format's largest finite value), and
//                 inv_scale = 1 / s, what scaled_mm takes as scale_a / scale_b.
// s is 1 where amax is 0 (an all-zero row) and NaN where amax is not finite, so an inf or NaN in
// x shows as NaN codes, never as a silently saturated tensor. Every f32 operation is rounded
// once and the same way as the CPU path (division and product in round-to-nearest, no FMA), and
// cvt.rn.satfinite rounds the product to FP8 as core::fp8::encode does: the codes match the CPU
// bit for bit. sm_89+ (the cvt to FP8).
#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_IN
#define FE_IN float
#endif
#ifndef FE_E5M2
#define FE_E5M2 0
#endif
typedef FE_IN TI;

// The format's largest finite value.
#define FE_FMAX (FE_E5M2 ? 57344.f : 448.f)

// NaN-propagating max of two magnitudes.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// One warp's max (every lane gets it).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// amax[r] = max_c |x[r][c]| (per_row), or amax[0] = max over x (amax[0] zeroed by the host; the
// bits of a non-negative float order as unsigned integers, and NaN's above +inf's).
extern "C" __global__ void __launch_bounds__(256)
    fp8_amax(const TI* __restrict__ x, i64 rows, i64 cols, float* __restrict__ amax, int per_row) {
  const int lane = threadIdx.x % 32;
  if (per_row) {
    const i64 warps = (i64)gridDim.x * 8;
    for (i64 r = (i64)blockIdx.x * 8 + threadIdx.x / 32; r < rows; r += warps) {
      const TI* row = x + r * cols;
      float m = 0.f;
      for (i64 c = lane; c < cols; c += 32) m = nan_max(m, fabsf(to_float(row[c])));
      m = warp_max(m);
      if (lane == 0) amax[r] = m;
    }
    return;
  }
  const i64 n = rows * cols, stride = (i64)gridDim.x * blockDim.x;
  float m = 0.f;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    m = nan_max(m, fabsf(to_float(x[i])));
  m = warp_max(m);
  if (lane == 0) atomicMax(reinterpret_cast<unsigned*>(amax), __float_as_uint(m));
}

__device__ __forceinline__ float scale_from_amax(float a) {
  if (a == 0.f) return 1.f;
  return isfinite(a) ? __fdiv_rn(FE_FMAX, a) : __int_as_float(0x7fc00000);
}

// Two floats to two FP8 codes, lo in the low byte.
__device__ __forceinline__ unsigned short cvt2(float lo, float hi) {
  unsigned short d;
#if FE_E5M2
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// q[i] = fp8(x[i] · s(row of i)), a thread per pair of elements (the pair may straddle two rows
// when cols is odd: each element takes its own row's scale). s(r) = scale[per_row ? r : 0] when
// `scale` is given, else scale_from_amax(amax[per_row ? r : 0]); inv_scale[r] = 1 / s(r) is
// written by the thread whose pair holds row r's first element.
extern "C" __global__ void __launch_bounds__(256)
    fp8_quantize(const TI* __restrict__ x, i64 rows, i64 cols, const float* __restrict__ scale,
                 const float* __restrict__ amax, int per_row, unsigned char* __restrict__ q,
                 float* __restrict__ inv_scale) {
  const i64 n = rows * cols, pairs = (n + 1) / 2, stride = (i64)gridDim.x * blockDim.x;
  auto s_of = [&](i64 r) {
    const i64 j = per_row ? r : 0;
    return scale ? scale[j] : scale_from_amax(amax[j]);
  };
  if (n == 0) {  // no elements: the scales still exist (amax 0, so s = 1 unless given)
    const i64 count = per_row ? rows : 1;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < count; r += stride)
      inv_scale[r] = __fdiv_rn(1.f, s_of(r));
    return;
  }
  for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += stride) {
    const i64 i0 = 2 * p, r0 = i0 / cols;
    const float s0 = s_of(r0);
    const float v0 = __fmul_rn(to_float(x[i0]), s0);
    if (i0 + 1 < n) {
      const i64 r1 = (i0 + 1) / cols;
      const float s1 = r1 == r0 ? s0 : s_of(r1);
      const unsigned short d = cvt2(v0, __fmul_rn(to_float(x[i0 + 1]), s1));
      // q's base is allocation-aligned and i0 even: a 2-byte store.
      *reinterpret_cast<unsigned short*>(q + i0) = d;
      if (per_row && r1 != r0) inv_scale[r1] = __fdiv_rn(1.f, s1);
    } else {
      q[i0] = (unsigned char)(cvt2(v0, 0.f) & 0xff);
    }
    // Row r0 starts in this pair (i0 == r0·cols, or i0 + 1 for odd cols handled above).
    if (i0 == r0 * cols && (per_row || r0 == 0)) inv_scale[per_row ? r0 : 0] = __fdiv_rn(1.f, s0);
  }
}
