// linear — the element-wise kernels of the linear family.
//
// Forward, unfused baseline (`naive`): after a plain GEMM wrote Y, three separate passes over Y —
// linear_bias (Y += b, Z = Y), linear_act (Y = act(Y)), linear_add (Y += R). Each pass reads and
// writes all of Y again: this is the traffic the fused epilogue (matmul's FE_EPI hook) removes.
//
// Backward: linear_bwd_dz computes dZ = dY ⊙ act'(Z) and, in the same pass, the column sums of dZ
// over a fixed chunk of rows per block (fp32, rows in order) into a [chunks, n] scratch;
// linear_db adds the chunks in a fixed order. No atomics: the same db bits every run.
//
// Specialised by -DFE_ELEM (storage type) and -DFE_ACT (0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf,
// 4 silu). Index math is 64-bit; every access is predicated on the matrix bounds.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
#ifndef FE_ACT
#define FE_ACT 0
#endif
typedef FE_ELEM T;

__device__ __forceinline__ float act(float v) {
#if FE_ACT == 1
  return (v > 0.f || isnan(v)) ? v : 0.f;  // NaN stays NaN, as torch's relu
#elif FE_ACT == 2
  const float u = 0.7978845608028654f * fmaf(0.044715f * v, v * v, v);
  return 0.5f * v * (1.f + tanhf(u));
#elif FE_ACT == 3
  return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
#elif FE_ACT == 4
  return v / (1.f + expf(-v));
#else
  return v;
#endif
}

// act'(v).
__device__ __forceinline__ float act_grad(float v) {
#if FE_ACT == 1
  return v > 0.f ? 1.f : 0.f;
#elif FE_ACT == 2
  const float c = 0.7978845608028654f, a = 0.044715f;
  const float t = tanhf(c * fmaf(a * v, v * v, v));
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * c * fmaf(3.f * a, v * v, 1.f);
#elif FE_ACT == 3
  return 0.5f * (1.f + erff(v * 0.7071067811865476f)) +
         v * 0.3989422804014327f * expf(-0.5f * v * v);
#elif FE_ACT == 4
  const float s = 1.f / (1.f + expf(-v));
  return s * fmaf(v, 1.f - s, 1.f);
#else
  return 1.f;
#endif
}

// Grid-stride over the m×n elements: element e is (e / n, e % n).
#define FOR_EACH_ELEMENT(m, n)                                                        \
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x, total = (m) * (n); e < total; \
       e += (i64)gridDim.x * blockDim.x)

// Y[i][j] += b[j] (b may be null); Z[i][j] = the result when z is not null.
extern "C" __global__ void linear_bias(T* __restrict__ y, i64 ldy, const T* __restrict__ b,
                                       T* __restrict__ z, i64 ldz, i64 m, i64 n) {
  FOR_EACH_ELEMENT(m, n) {
    const i64 i = e / n, j = e - i * n;
    float v = to_float(y[i * ldy + j]);
    if (b) v += to_float(b[j]);
    y[i * ldy + j] = from_float<T>(v);
    if (z) z[i * ldz + j] = from_float<T>(v);
  }
}

extern "C" __global__ void linear_act(T* __restrict__ y, i64 ldy, i64 m, i64 n) {
  FOR_EACH_ELEMENT(m, n) {
    const i64 i = e / n, j = e - i * n;
    y[i * ldy + j] = from_float<T>(act(to_float(y[i * ldy + j])));
  }
}

extern "C" __global__ void linear_add(T* __restrict__ y, i64 ldy, const T* __restrict__ r, i64 ldr,
                                      i64 m, i64 n) {
  FOR_EACH_ELEMENT(m, n) {
    const i64 i = e / n, j = e - i * n;
    y[i * ldy + j] = from_float<T>(to_float(y[i * ldy + j]) + to_float(r[i * ldr + j]));
  }
}

// dx[i][j] *= act'(z[i][j]): the unfused form of the dX GEMM's activation-backward epilogue
// (matmul's FE_EPI_DACT), forming the layer below's dZ after a plain GEMM — one more read and
// write of dX, and a second rounding.
extern "C" __global__ void linear_dact(T* __restrict__ dx, i64 lddx, const T* __restrict__ z,
                                       i64 ldz, i64 m, i64 n) {
  FOR_EACH_ELEMENT(m, n) {
    const i64 i = e / n, j = e - i * n;
    dx[i * lddx + j] = from_float<T>(to_float(dx[i * lddx + j]) * act_grad(to_float(z[i * ldz + j])));
  }
}

// Block (x: columns, y: row chunk). Thread = one column j of rows [chunk·rows, (chunk+1)·rows):
// a warp reads 32 consecutive columns of a row (coalesced), walking rows in order.
// dz (null: not written, e.g. when dZ = dY) and partial (null: no db) are optional; z is read
// only for an activation.
extern "C" __global__ void linear_bwd_dz(const T* __restrict__ dy, i64 lddy, const T* __restrict__ z,
                                         i64 ldz, T* __restrict__ dz, i64 lddz,
                                         float* __restrict__ partial, i64 m, i64 n,
                                         i64 rows_per_chunk) {
  const i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const i64 r0 = (i64)blockIdx.y * rows_per_chunk;
  const i64 r1 = min(m, r0 + rows_per_chunk);
  float s = 0.f;
#pragma unroll 4
  for (i64 i = r0; i < r1; ++i) {
    float g = to_float(dy[i * lddy + j]);
#if FE_ACT != 0
    g *= act_grad(to_float(z[i * ldz + j]));
#endif
    if (dz) dz[i * lddz + j] = from_float<T>(g);
    s += g;
  }
  if (partial) partial[(i64)blockIdx.y * n + j] = s;
}

// db[j] = Σ_c partial[c][j] in a fixed order (col_sum_fixed_order: 16 chunk slices per column
// in flight, then added in slice order; the same bits every run), the helper the norm backward
// uses. An earlier version ran one thread per column walking all its chunks (~128 dependent loads
// at 8192 rows); a suspect for the backward's non-GEMM time, but the H100 timed no difference
// (docs/linear.md, "Backward"). Launch with blockDim (32, 16), gridDim.x = ⌈n / 32⌉.
extern "C" __global__ void linear_db(const float* __restrict__ partial, i64 chunks, i64 n,
                                     T* __restrict__ db) {
  col_sum_fixed_order(db, partial, chunks, n);
}

// dW = Σ_j part[j] over the split-K partials [split, count] (fp32 sums in slice order).
extern "C" __global__ void linear_splitk_sum(const T* __restrict__ part, i64 split, i64 count,
                                             T* __restrict__ out) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (i64 j = 0; j < split; ++j) s += to_float(part[j * count + i]);
    out[i] = from_float<T>(s);
  }
}
