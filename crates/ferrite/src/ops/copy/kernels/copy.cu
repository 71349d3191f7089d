// copy — the device-to-device copy that measures the memory-bandwidth ceiling every
// memory-bound kernel is compared against (bytes read + bytes written per second).
//
// copy_naive:      one 4-byte word per thread, one launch-wide pass. Coalesced, but each thread
//                  has a single load in flight, so latency is hidden only by the number of warps.
// copy_vectorized: 16-byte loads and stores (LDG.E.128 / STG.E.128), FE_UNROLL of them in flight per
//                  thread before the first store, over a grid sized to fill the SMs: fewer
//                  instructions per byte and more bytes in flight per thread.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_UNROLL
#define FE_UNROLL 4
#endif

extern "C" __global__ void copy_naive(unsigned int* __restrict__ dst,
                                      const unsigned int* __restrict__ src, i64 words) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < words) dst[i] = src[i];
}

// dst/src are 16-byte aligned; `vecs` 16-byte vectors. The host copies any tail bytes.
extern "C" __global__ void copy_vectorized(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                           i64 vecs) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (FE_UNROLL - 1) * stride < vecs; i += FE_UNROLL * stride) {
    uint4 v[FE_UNROLL];
#pragma unroll
    for (int u = 0; u < FE_UNROLL; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < FE_UNROLL; ++u) __stcs(dst + i + u * stride, v[u]);
  }
  for (; i < vecs; i += stride) dst[i] = src[i];
}
