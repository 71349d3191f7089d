// softmax — y = softmax(scale·x) over the last dim, and its backward dx = scale·y·(dy − Σ dy·y).
//
// Specialisation: -DFE_ELEM=<storage type>, -DFE_CHUNKS=<16-byte vectors per thread> (vectorized).
// Arithmetic in fp32; exp through exp2f with log2(e) folded into the scale.
//
// forward, step 1 — softmax_fwd_naive: a block per row, three passes over global memory (max,
//   Σexp, write), scalar loads: x is read three times.
// forward, step 2 — softmax_fwd_vec: the row in registers after one 16-byte-load read; max and
//   Σexp from registers; one write. One read + one write per element, like a copy.
// backward, step 1 — softmax_bwd_naive: a block per row, two passes (Σ dy·y, then dx).
// backward, step 2 — softmax_bwd_vec: dy and y held in registers after one read each.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
#ifndef FE_CHUNKS
#define FE_CHUNKS 1
#endif

typedef FE_ELEM T;
typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;
#define LOG2E 1.4426950408889634f

extern "C" __global__ void softmax_fwd_naive(T* __restrict__ y, const T* __restrict__ x, i64 rows,
                                             i64 cols, float scale) {
  __shared__ float red[64];
  const float s2 = scale * LOG2E;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    float m = -__int_as_float(0x7f800000);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_float(xr[c]) * s2);
    m = block_max(m, red);
    float s = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += exp2f(to_float(xr[c]) * s2 - m);
    const float inv = 1.f / block_sum(s, red);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
      y[row * cols + c] = from_float<T>(exp2f(to_float(xr[c]) * s2 - m) * inv);
  }
}

// Requires cols % VEC == 0, 16-byte aligned rows and cols <= blockDim.x * FE_CHUNKS * VEC.
extern "C" __global__ void softmax_fwd_vec(T* __restrict__ y, const T* __restrict__ x, i64 rows,
                                           i64 cols, float scale) {
  __shared__ float red[64];
  const float s2 = scale * LOG2E;
  const i64 nvec = cols / VEC;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const Vec* xr = reinterpret_cast<const Vec*>(x + row * cols);
    float v[FE_CHUNKS][VEC];
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        const Vec a = xr[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          v[k][e] = to_float(a.v[e]) * s2;
          m = fmaxf(m, v[k][e]);
        }
      }
    }
    m = block_max(m, red);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      if (threadIdx.x + (i64)k * blockDim.x < nvec) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          v[k][e] = exp2f(v[k][e] - m);
          s += v[k][e];
        }
      }
    }
    const float inv = 1.f / block_sum(s, red);
    Vec* yr = reinterpret_cast<Vec*>(y + row * cols);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        Vec o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(v[k][e] * inv);
        yr[i] = o;
      }
    }
  }
}

extern "C" __global__ void softmax_bwd_naive(T* __restrict__ dx, const T* __restrict__ dy,
                                             const T* __restrict__ y, i64 rows, i64 cols,
                                             float scale) {
  __shared__ float red[64];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 base = row * cols;
    float d = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) d += to_float(dy[base + c]) * to_float(y[base + c]);
    d = block_sum(d, red);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
      dx[base + c] = from_float<T>(scale * to_float(y[base + c]) * (to_float(dy[base + c]) - d));
  }
}

extern "C" __global__ void softmax_bwd_vec(T* __restrict__ dx, const T* __restrict__ dy,
                                           const T* __restrict__ y, i64 rows, i64 cols,
                                           float scale) {
  __shared__ float red[64];
  const i64 nvec = cols / VEC;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const Vec* dyr = reinterpret_cast<const Vec*>(dy + row * cols);
    const Vec* yr = reinterpret_cast<const Vec*>(y + row * cols);
    float g[FE_CHUNKS][VEC], p[FE_CHUNKS][VEC];
    float d = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        const Vec a = dyr[i], b = yr[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          g[k][e] = to_float(a.v[e]);
          p[k][e] = to_float(b.v[e]);
          d += g[k][e] * p[k][e];
        }
      }
    }
    d = block_sum(d, red);
    Vec* dxr = reinterpret_cast<Vec*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        Vec o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(scale * p[k][e] * (g[k][e] - d));
        dxr[i] = o;
      }
    }
  }
}
