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

// Whether a 16-bit element type is bf16 (picks the bf16 or f16 form of an instruction).
template <typename U> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// The 32-bit shared-state-space address of a shared-memory pointer, as PTX instructions on
// shared memory (cp.async, ldmatrix, mbarrier, TMA) take it.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// The dynamic shared memory the launch gave this block, in bytes.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned v;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(v));
  return v;
}

// Block-wide sums of two floats; every thread receives both totals. blockDim.x must be a multiple
// of 32; `red` is 64 floats of shared memory owned by the caller.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();  // the previous call's readers are done with `red`
  if (lane == 0) {
    red[warp] = a;
    red[32 + warp] = b;
  }
  __syncthreads();
  a = lane < nw ? red[lane] : 0.f;
  b = lane < nw ? red[32 + lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  return make_float2(a, b);
}

__device__ __forceinline__ float block_sum(float a, float* red) { return block_sum2(a, 0.f, red).x; }

// Block-wide maximum; every thread receives it. Same contract as block_sum2.
__device__ __forceinline__ float block_max(float a, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = a;
  __syncthreads();
  a = lane < nw ? red[lane] : -__int_as_float(0x7f800000);  // -inf
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// p[0] += x, p[1] += y in global memory (p 8-byte aligned), no value returned: one vector
// reduction on sm_90+, two scalar ones before.
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(y) : "memory");
#endif
}

// A 16-byte vector of storage elements, for 128-bit loads and stores.
template <typename E>
struct alignas(16) Vec16 {
  static constexpr int N = 16 / sizeof(E);
  E v[N];
};

// out[c] = Σ_p part[p, c] over `parts` fp32 partial rows, in a fixed order (the same bits every
// run): a block of (32, 16) threads owns 32 columns; thread row ty sums parts ty, ty+16, ... in
// order, then the 16 sums are added in ty order — 16 loads in flight per column instead of one
// thread walking all the parts. Launch with blockDim (32, 16), gridDim.x = ⌈cols / 32⌉.
template <typename T>
__device__ __forceinline__ void col_sum_fixed_order(T* __restrict__ out, const float* __restrict__ part,
                                                    i64 parts, i64 cols) {
  __shared__ float s[16][33];
  const i64 c = (i64)blockIdx.x * 32 + threadIdx.x;
  float a = 0.f;
  if (c < cols)
    for (i64 p = threadIdx.y; p < parts; p += 16) a += part[p * cols + c];
  s[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < 16; ++k) t += s[k][threadIdx.x];
    out[c] = from_float<T>(t);
  }
}

}  // namespace ferrite

#endif  // FERRITE_CUH
