// norm — LayerNorm and RMSNorm, forward and backward, with the fused residual add of a
// transformer block (h = x + residual; y = norm(h)·w + b).
//
// Specialisation: -DFE_ELEM=<storage type>, -DFE_RMS=1 for RMSNorm (no mean, no bias) or 0 for
// LayerNorm, -DFE_CHUNKS=<16-byte vectors per thread> for the vectorized kernels. All arithmetic
// in fp32; mean and rstd are saved in fp32 for the backward pass.
//
// forward, step 1 — norm_fwd_naive: one block per row, three passes over the row in global memory
//   (mean, variance, normalise), scalar loads. Reads x three times: ~3 + 1 transfers per element,
//   so at best ~half of the copy bandwidth, and the scalar 2-byte loads of bf16 issue four times as
//   many load instructions as 16-byte ones.
// forward, step 2 — norm_fwd_vec: one block per row, the row held in registers after a single
//   read with 16-byte loads (FE_CHUNKS vectors per thread), mean and variance from registers
//   (two-pass, exact), one write. One read + one write per element: the copy's traffic, so the
//   target is the copy bandwidth.
// backward, step 1 — norm_bwd_naive: one block per row for dx; per-row partial products for dw/db
//   written to a rows×cols fp32 scratch and summed per column by a second kernel in a fixed order
//   (deterministic, no atomics) — but the scratch doubles the traffic.
// backward, step 2 — norm_bwd_vec: a fixed grid of G blocks, each walking rows G apart with its
//   columns' dw/db accumulated in registers; one G×cols partial per block, then the same fixed-order
//   column sum. Deterministic (same bits every run on the same GPU) and ~one pass over dy, x, dx.
//   The next row's dy and x are loaded before the current row's reduction (a two-row software
//   pipeline): measured without it, bf16 reached 74–81% of copy with the loads idle during the
//   barriers; prediction with it: ~90%.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
#ifndef FE_RMS
#define FE_RMS 0
#endif
#ifndef FE_CHUNKS
#define FE_CHUNKS 4
#endif

typedef FE_ELEM T;
typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;

// h = x + residual, rounded to the storage type (the value a separate add kernel would store).
__device__ __forceinline__ float add_residual(float x, const T* res, i64 i) {
  return res ? to_float(from_float<T>(x + to_float(res[i]))) : x;
}

extern "C" __global__ void norm_fwd_naive(T* __restrict__ y, T* __restrict__ h_out,
                                          float* __restrict__ mean_out,
                                          float* __restrict__ rstd_out, const T* __restrict__ x,
                                          const T* __restrict__ res, const T* __restrict__ w,
                                          const T* __restrict__ b, i64 rows, i64 cols, float eps) {
  __shared__ float red[64];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 base = row * cols;
    float mean = 0.f;
#if !FE_RMS
    float s = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += add_residual(to_float(x[base + c]), res, base + c);
    mean = block_sum(s, red) / (float)cols;
#endif
    float ss = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float d = add_residual(to_float(x[base + c]), res, base + c) - mean;
      ss += d * d;
    }
    const float rstd = rsqrtf(block_sum(ss, red) / (float)cols + eps);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = add_residual(to_float(x[base + c]), res, base + c);
      if (h_out) h_out[base + c] = from_float<T>(v);
      float o = (v - mean) * rstd;
      if (w) o *= to_float(w[c]);
      if (b) o += to_float(b[c]);
      y[base + c] = from_float<T>(o);
    }
    if (threadIdx.x == 0) {
      if (mean_out) mean_out[row] = mean;
      if (rstd_out) rstd_out[row] = rstd;
    }
  }
}

// Requires cols % VEC == 0, 16-byte aligned rows, and cols <= blockDim.x * FE_CHUNKS * VEC.
extern "C" __global__ void norm_fwd_vec(T* __restrict__ y, T* __restrict__ h_out,
                                        float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                        const T* __restrict__ x, const T* __restrict__ res,
                                        const T* __restrict__ w, const T* __restrict__ b, i64 rows,
                                        i64 cols, float eps) {
  __shared__ float red[64];
  const i64 nvec = cols / VEC;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const Vec* xr = reinterpret_cast<const Vec*>(x + row * cols);
    const Vec* rr = res ? reinterpret_cast<const Vec*>(res + row * cols) : nullptr;
    float v[FE_CHUNKS][VEC];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        const Vec a = xr[i];
        Vec r;
        if (rr) r = rr[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float t = to_float(a.v[e]);
          if (rr) t = to_float(from_float<T>(t + to_float(r.v[e])));
          v[k][e] = t;
          s += t;
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[k][e] = 0.f;
      }
    }
    float mean = 0.f;
#if !FE_RMS
    mean = block_sum(s, red) / (float)cols;
#endif
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      if (threadIdx.x + (i64)k * blockDim.x < nvec) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = v[k][e] - mean;
          ss += d * d;
        }
      }
    }
    const float rstd = rsqrtf(block_sum(ss, red) / (float)cols + eps);
    Vec* yr = reinterpret_cast<Vec*>(y + row * cols);
    Vec* hr = h_out ? reinterpret_cast<Vec*>(h_out + row * cols) : nullptr;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        Vec wv, bv, o, h;
        if (w) wv = reinterpret_cast<const Vec*>(w)[i];
        if (b) bv = reinterpret_cast<const Vec*>(b)[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float t = (v[k][e] - mean) * rstd;
          if (w) t *= to_float(wv.v[e]);
          if (b) t += to_float(bv.v[e]);
          o.v[e] = from_float<T>(t);
          h.v[e] = from_float<T>(v[k][e]);
        }
        yr[i] = o;
        if (hr) hr[i] = h;
      }
    }
    if (threadIdx.x == 0) {
      if (mean_out) mean_out[row] = mean;
      if (rstd_out) rstd_out[row] = rstd;
    }
  }
}

// dx for one row from g = dy·w and x̂ = (x − mean)·rstd:
//   RMSNorm:   dx = rstd · (g − x̂ · mean(g·x̂))
//   LayerNorm: dx = rstd · (g − mean(g) − x̂ · mean(g·x̂))
extern "C" __global__ void norm_bwd_naive(T* __restrict__ dx, float* __restrict__ dw_part,
                                          float* __restrict__ db_part, const T* __restrict__ dy,
                                          const T* __restrict__ x, const T* __restrict__ w,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd, i64 rows, i64 cols) {
  __shared__ float red[64];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 base = row * cols;
    const float mu = mean ? mean[row] : 0.f, rs = rstd[row];
    float sg = 0.f, sgx = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float g = to_float(dy[base + c]) * (w ? to_float(w[c]) : 1.f);
      const float xh = (to_float(x[base + c]) - mu) * rs;
      sg += g;
      sgx += g * xh;
    }
    const float2 t = block_sum2(sg, sgx, red);
    const float mg = FE_RMS ? 0.f : t.x / (float)cols, mgx = t.y / (float)cols;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float d = to_float(dy[base + c]);
      const float g = d * (w ? to_float(w[c]) : 1.f);
      const float xh = (to_float(x[base + c]) - mu) * rs;
      dx[base + c] = from_float<T>(rs * (g - mg - xh * mgx));
      if (dw_part) dw_part[base + c] = d * xh;
      if (db_part) db_part[base + c] = d;
    }
  }
}

// Requires what norm_fwd_vec requires. gridDim.x blocks each own rows blockIdx.x + k·gridDim.x and
// write one partial row (G × cols) of dw and db.
extern "C" __global__ void norm_bwd_vec(T* __restrict__ dx, float* __restrict__ dw_part,
                                        float* __restrict__ db_part, const T* __restrict__ dy,
                                        const T* __restrict__ x, const T* __restrict__ w,
                                        const float* __restrict__ mean,
                                        const float* __restrict__ rstd, i64 rows, i64 cols) {
  __shared__ float red[64];
  const i64 nvec = cols / VEC;
  float wr[FE_CHUNKS][VEC], dwa[FE_CHUNKS][VEC], dba[FE_CHUNKS][VEC];
#pragma unroll
  for (int k = 0; k < FE_CHUNKS; ++k) {
    const i64 i = threadIdx.x + (i64)k * blockDim.x;
    Vec wv;
    if (w && i < nvec) wv = reinterpret_cast<const Vec*>(w)[i];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      wr[k][e] = (w && i < nvec) ? to_float(wv.v[e]) : 1.f;
      dwa[k][e] = 0.f;
      dba[k][e] = 0.f;
    }
  }
  // Software pipeline: the next row's dy and x are loaded (raw 16-byte vectors) before this
  // row's reduction, so a block keeps loads in flight through its barriers.
  Vec ca[FE_CHUNKS], cb[FE_CHUNKS];
  float cmu = 0.f, crs = 0.f;
  auto load_row = [&](i64 r, Vec* a, Vec* b, float& m_, float& s_) {
    const Vec* dyr = reinterpret_cast<const Vec*>(dy + r * cols);
    const Vec* xr = reinterpret_cast<const Vec*>(x + r * cols);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        a[k] = dyr[i];
        b[k] = xr[i];
      }
    }
    m_ = mean ? mean[r] : 0.f;
    s_ = rstd[r];
  };
  if (blockIdx.x < rows) load_row(blockIdx.x, ca, cb, cmu, crs);
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    Vec na[FE_CHUNKS], nb[FE_CHUNKS];
    float nmu = 0.f, nrs = 0.f;
    if (row + gridDim.x < rows) load_row(row + gridDim.x, na, nb, nmu, nrs);
    const float mu = cmu, rs = crs;
    float d[FE_CHUNKS][VEC], xh[FE_CHUNKS][VEC];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          d[k][e] = to_float(ca[k].v[e]);
          xh[k][e] = (to_float(cb[k].v[e]) - mu) * rs;
          const float g = d[k][e] * wr[k][e];
          sg += g;
          sgx += g * xh[k][e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) d[k][e] = xh[k][e] = 0.f;
      }
    }
    const float2 t = block_sum2(sg, sgx, red);
    const float mg = FE_RMS ? 0.f : t.x / (float)cols, mgx = t.y / (float)cols;
    Vec* dxr = reinterpret_cast<Vec*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        Vec o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          o.v[e] = from_float<T>(rs * (d[k][e] * wr[k][e] - mg - xh[k][e] * mgx));
          dwa[k][e] += d[k][e] * xh[k][e];
          dba[k][e] += d[k][e];
        }
        dxr[i] = o;
      }
    }
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      ca[k] = na[k];
      cb[k] = nb[k];
    }
    cmu = nmu;
    crs = nrs;
  }
#pragma unroll
  for (int k = 0; k < FE_CHUNKS; ++k) {
    const i64 i = threadIdx.x + (i64)k * blockDim.x;
    if (i < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const i64 c = i * VEC + e;
        if (dw_part) dw_part[blockIdx.x * cols + c] = dwa[k][e];
        if (db_part) db_part[blockIdx.x * cols + c] = dba[k][e];
      }
    }
  }
}

// out[c] = Σ_p part[p·cols + c] for p = 0..parts−1 in order: the deterministic second stage of
// the weight/bias gradients. A thread per column, coalesced across the warp.
extern "C" __global__ void norm_col_sum(T* __restrict__ out, const float* __restrict__ part,
                                        i64 parts, i64 cols) {
  const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (i64 p = 0; p < parts; ++p) s += part[p * cols + c];
  out[c] = from_float<T>(s);
}
