// ferrite.cuh — device helpers shared by every ferrite kernel (expanded into each module by the JIT).
#ifndef FERRITE_CUH
#define FERRITE_CUH

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ferrite {

typedef long long i64;
typedef unsigned long long u64;

// Conversions to and from the float accumulator type, one overload per storage type.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__host__ __device__ __forceinline__ i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

}  // namespace ferrite

#endif  // FERRITE_CUH
