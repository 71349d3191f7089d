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
//   barriers; with it 82–86% (bf16) — the prefetched vectors cost registers (121 at chunks = 2,
//   occupancy 25%), so one bf16 row (16 KB of dy + x) per block, 32 KB per SM, was in flight.
// backward, step 3 (same rung, replacing the register prefetch) — rows stream through a
//   STAGES-deep cp.async ring in shared memory: each thread copies its own 16-byte vectors of
//   rows r+1 … r+STAGES−1 while it computes row r and reads back only what it copied (so the
//   ring needs cp.async.wait_group, no barrier). STAGES − 1 = 2 rows in flight per block at no
//   register cost (the raw prefetch vectors leave the registers): 64 KB per SM for bf16 at
//   2 blocks/SM, what f32 had when it reached 94%. The partial rows are then summed by
//   norm_col_sum with 16 threads per column (it was one thread per column walking all G partial
//   rows, ~10 µs of latency per launch, run once for dw and again for db).

#include "ferrite.cuh"
#include "async.cuh"

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
// Rows in the backward's shared-memory ring (STAGES − 1 of them in flight ahead of the one used).
#ifndef FE_STAGES
#define FE_STAGES 3
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

// Requires what norm_fwd_vec requires, and FE_STAGES·2·cols·sizeof(T) bytes of dynamic shared
// memory (the ring: stage s holds dy then x of one row, cols/VEC vectors each). gridDim.x blocks
// each own rows blockIdx.x + j·gridDim.x and write one partial row (G × cols) of dw and db.
extern "C" __global__ void norm_bwd_vec(T* __restrict__ dx, float* __restrict__ dw_part,
                                        float* __restrict__ db_part, const T* __restrict__ dy,
                                        const T* __restrict__ x, const T* __restrict__ w,
                                        const float* __restrict__ mean,
                                        const float* __restrict__ rstd, i64 rows, i64 cols) {
  constexpr int S = FE_STAGES;
  static_assert(S >= 2, "the ring needs a stage being read and one being filled");
  __shared__ float red[64];
  extern __shared__ __align__(16) unsigned char ring_raw[];
  Vec* ring = reinterpret_cast<Vec*>(ring_raw);
  const i64 nvec = cols / VEC;
  const i64 G = gridDim.x;
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
  // The block's j-th row is blockIdx.x + j·G; it lives in stage j % S. Each thread copies (and
  // later reads) only its own vectors, so a stage is reused without a barrier. mean/rstd of the
  // rows in flight ride along in registers (mq/rq[t] = row j + t).
  float mq[S], rq[S];
  auto issue = [&](i64 j, int stage) {
    const i64 r = blockIdx.x + j * G;
    if (r < rows) {
      Vec* st = ring + stage * 2 * nvec;
      const Vec* dyr = reinterpret_cast<const Vec*>(dy + r * cols);
      const Vec* xr = reinterpret_cast<const Vec*>(x + r * cols);
#pragma unroll
      for (int k = 0; k < FE_CHUNKS; ++k) {
        const i64 i = threadIdx.x + (i64)k * blockDim.x;
        if (i < nvec) {
          cp_async16(st + i, dyr + i);
          cp_async16(st + nvec + i, xr + i);
        }
      }
    }
    cp_async_commit();  // an empty group past the last row keeps the wait count uniform
  };
  auto stats = [&](i64 j, float& m_, float& s_) {
    const i64 r = blockIdx.x + j * G;
    m_ = (mean && r < rows) ? mean[r] : 0.f;
    s_ = r < rows ? rstd[r] : 0.f;
  };
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    issue(t, t);
    stats(t, mq[t], rq[t]);
  }
  // cur = j % S (read), nxt = (j + S − 1) % S (filled now: the stage row j − 1 used).
  int cur = 0, nxt = S - 1;
  for (i64 j = 0, row = blockIdx.x; row < rows; ++j, row += G) {
    issue(j + S - 1, nxt);  // this thread finished reading that stage in the previous iteration
    stats(j + S - 1, mq[S - 1], rq[S - 1]);
    cp_async_wait<S - 1>();  // row j's group (and every older one) has landed
    const float mu = mq[0], rs = rq[0];
    const Vec* st = ring + cur * 2 * nvec;
    // dy and x̂ are not kept in registers between the reduction and the dx pass: the second pass
    // reads the thread's own vectors of the stage again (two shared loads per vector; the stage
    // is refilled only in the next iteration). 16 registers per chunk less (layer, chunks = 4:
    // 204 → ~140), so more blocks fit an SM and more rows are in flight.
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        const Vec a = st[i], b = st[nvec + i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xh = (to_float(b.v[e]) - mu) * rs;
          const float g = to_float(a.v[e]) * wr[k][e];
          sg += g;
          sgx += g * xh;
        }
      }
    }
    const float2 t = block_sum2(sg, sgx, red);
    const float mg = FE_RMS ? 0.f : t.x / (float)cols, mgx = t.y / (float)cols;
    Vec* dxr = reinterpret_cast<Vec*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < FE_CHUNKS; ++k) {
      const i64 i = threadIdx.x + (i64)k * blockDim.x;
      if (i < nvec) {
        const Vec a = st[i], b = st[nvec + i];
        Vec o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = to_float(a.v[e]), xh = (to_float(b.v[e]) - mu) * rs;
          o.v[e] = from_float<T>(rs * (d * wr[k][e] - mg - xh * mgx));
          dwa[k][e] += d * xh;
          if (!FE_RMS) dba[k][e] += d;  // RMSNorm has no bias (the API refuses dbias)
        }
        dxr[i] = o;
      }
    }
#pragma unroll
    for (int u = 0; u < S - 1; ++u) {
      mq[u] = mq[u + 1];
      rq[u] = rq[u + 1];
    }
    nxt = cur;
    cur = cur + 1 == S ? 0 : cur + 1;
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the block exits
  // The partial rows go out as 16-byte stores: a thread's VEC columns are contiguous, so a warp's
  // float4 store covers whole sectors (f32) or every other 16 bytes of them (16-bit types, two
  // stores). Scalar stores touched a sector per 4 bytes: at bf16 8 sector writes per sector, all
  // in a burst at the kernel's end (ncu: 7% of the kernel's sectors excessive, LayerNorm twice
  // RMSNorm's with its db partial).
  static_assert(VEC % 4 == 0, "partials are written as float4");
#pragma unroll
  for (int k = 0; k < FE_CHUNKS; ++k) {
    const i64 i = threadIdx.x + (i64)k * blockDim.x;
    if (i < nvec) {
      // cols % VEC == 0 (the vectorized rung's precondition): i·VEC floats into a row of cols
      // floats is 16-byte aligned in the 256-byte-aligned partial buffer.
      float4* dwp = dw_part ? reinterpret_cast<float4*>(dw_part + blockIdx.x * cols + i * VEC) : nullptr;
      float4* dbp = (!FE_RMS && db_part)
                        ? reinterpret_cast<float4*>(db_part + blockIdx.x * cols + i * VEC)
                        : nullptr;
#pragma unroll
      for (int e = 0; e < VEC; e += 4) {
        if (dwp) dwp[e / 4] = make_float4(dwa[k][e], dwa[k][e + 1], dwa[k][e + 2], dwa[k][e + 3]);
        if (dbp) dbp[e / 4] = make_float4(dba[k][e], dba[k][e + 1], dba[k][e + 2], dba[k][e + 3]);
      }
    }
  }
}

// out[c] = Σ_p part[p·cols + c] over `parts` partial rows: the deterministic second stage of the
// weight/bias gradients, for up to two (out, part) pairs at once (blockIdx.y; a null out skips
// its pair), in the fixed order of `col_sum_fixed_order` (ferrite.cuh).
extern "C" __global__ void norm_col_sum(T* __restrict__ out0, const float* __restrict__ part0,
                                        T* __restrict__ out1, const float* __restrict__ part1,
                                        i64 parts, i64 cols) {
  T* out = blockIdx.y ? out1 : out0;
  const float* part = blockIdx.y ? part1 : part0;
  if (!out) return;  // uniform across the block: no barrier is skipped by part of it
  col_sum_fixed_order(out, part, parts, cols);
}
