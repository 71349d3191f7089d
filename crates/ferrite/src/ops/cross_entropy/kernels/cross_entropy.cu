// cross_entropy — softmax cross-entropy over rows of logits [N, V] with class-index targets [N],
// ignore_index, label smoothing ε, and the gradient dlogits in the same call.
//
//   lse_i  = log Σ_j exp(x_ij)
//   loss_i = lse_i − (1−ε)·x_{i,t_i} − (ε/V)·Σ_j x_ij            (0 for an ignored row)
//   dx_ij  = scale · (softmax(x_i)_j − (1−ε)·[j = t_i] − ε/V)     (0 for an ignored row)
//   scale  = dloss / (number of non-ignored rows) for `mean`, dloss for `sum` / `none`
//
// Rows of x and dx are `ld` elements apart (ld ≥ V, the last dim contiguous): the logits may be a
// [N, V] view of a wider buffer, e.g. a vocabulary padded for the classifier's GEMMs.
//
// Specialisation: -DFE_ELEM=<logits/grad storage type>, -DFE_TGT=<target type: long long | int>.
// Arithmetic in fp32; exp through exp2f with log2(e) folded in.
//
// ce_targets  — one block: counts the non-ignored rows (the `mean` divisor, needed before any
//   gradient is written) and finds the first row whose target is neither ignore_index nor in
//   [0, V); writes [count:i32, pad, first bad row:u64 (or ~0), its value:i64] to `status`.
// unfused (CUDA `naive`), three passes and an N×V f32 intermediate:
//   ce_naive_logsoftmax — log-softmax of each row into `logp` (three scalar passes over the row);
//   ce_naive_loss       — loss_i from logp (reads the target's entry, and the row for smoothing);
//   ce_naive_grad       — dx = scale·(exp(logp) − smoothed one-hot), reading logp again.
// fused (CUDA `fused`), ce_fused — a block per row: one pass with 16-byte loads keeps a running
//   (max, Σexp) per thread (rescaled when the max grows) and Σx; a block reduction gives lse; a
//   second pass re-reads the row (mostly from L2) and writes dx. The row is read twice, dx
//   written once, and nothing else touches memory. dx may be the logits buffer itself (in place):
//   each element is read and then overwritten by the same thread, after the reductions, and the
//   target logit is read before the first barrier.
// resident (CUDA `resident`), ce_resident — ce_fused with the row kept on chip: pass 1 also
//   stores each 16-byte vector into dynamic shared memory (the first `cap` vectors of the row:
//   all of it when 2 rows' worth fit an SM, ~90% of a 256 KB row at one block per SM), pass 2
//   reads them back from there, so HBM sees each logit once (ce_fused's second read came from
//   L2 at best, from DRAM once the rows in flight outgrew the L2: 66% of copy at V = 128256).
//   A thread reads back only the vectors it stored (same i ↔ same thread for every row), so no
//   extra barrier. Also fewer instructions per element (ce_fused counted ~30 of a ~38-slot budget
//   at bf16, 3 TB/s): the max is taken on x per vector and log2(e) folded into one FFMA before a
//   bare ex2.approx; pass 2 is ex2(x·log2e − M)·(scale/S) − scale·(ε/V + (1−ε)[j = t]) with the
//   target compared as a 32-bit lane index per vector. Pass 1 brings the kept vectors in by
//   cp.async (the thread's whole share of the row in flight at once, no registers held), then
//   reads them from shared memory; loading them into registers and storing them kept only ~2 in
//   flight per thread under the 32-register cap.
// ce_reduce — one block: the scalar loss, Σ loss_i (÷ count for mean) in a fixed order.
//
// A target outside [0, V) (and ≠ ignore_index) is never used as an index: the row's loss and
// gradient are NaN and ce_targets has reported the row; the host turns it into an error.

#include "ferrite.cuh"
#include "async.cuh"
#include "sfu.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
#ifndef FE_TGT
#define FE_TGT long long
#endif

typedef FE_ELEM T;
typedef FE_TGT TG;
typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ float f_nan() { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ float f_ninf() { return -__int_as_float(0x7f800000); }
// The running maxima of ce_fused / ce_resident start here, not at −inf: a thread whose first
// elements are all −inf (masked classes) would otherwise add 2^(−inf − (−inf)) = NaN to its sum;
// from −FLT_MAX they add 2^−inf = 0 (and the rescale of the still-zero sum stays 0).
__device__ __forceinline__ float f_lowest() { return -__int_as_float(0x7f7fffff); }

// Status layout written by ce_targets (32 bytes).
struct Status {
  int count;
  int pad;
  u64 bad_row;
  long long bad_value;
};

extern "C" __global__ void ce_targets(Status* __restrict__ status, const TG* __restrict__ tgt,
                                      i64 n, i64 v, i64 ignore) {
  __shared__ u64 red_row[32];
  __shared__ int red_cnt[32];
  u64 bad = ~0ull;
  int cnt = 0;
  for (i64 r = threadIdx.x; r < n; r += blockDim.x) {
    const i64 t = (i64)tgt[r];
    if (t == ignore) continue;
    if (t >= 0 && t < v) {
      ++cnt;
    } else if ((u64)r < bad) {
      bad = (u64)r;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 ob = __shfl_xor_sync(0xffffffffu, bad, o);
    bad = ob < bad ? ob : bad;
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) {
    red_row[warp] = bad;
    red_cnt[warp] = cnt;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 b = ~0ull;
    int c = 0;
    for (int w = 0; w < nw; ++w) {
      b = red_row[w] < b ? red_row[w] : b;
      c += red_cnt[w];
    }
    status->count = c;
    status->pad = 0;
    status->bad_row = b;
    status->bad_value = b == ~0ull ? 0 : (long long)tgt[b];
  }
}

// Whether row target `t` is usable as an index; `ignored` is set for ignore_index.
__device__ __forceinline__ bool target_ok(i64 t, i64 v, i64 ignore, bool& ignored) {
  ignored = t == ignore;
  return ignored || (t >= 0 && t < v);
}

__device__ __forceinline__ float grad_scale(const Status* status, float dloss, int mean) {
  return mean ? dloss / (float)status->count : dloss;
}

// ---------------------------------------------------------------- unfused (CUDA `naive`)

extern "C" __global__ void ce_naive_logsoftmax(float* __restrict__ logp, const T* __restrict__ x,
                                               i64 n, i64 v, i64 ld) {
  __shared__ float red[64];
  for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = x + row * ld;
    float m = f_ninf();
    for (i64 c = threadIdx.x; c < v; c += blockDim.x) m = fmaxf(m, to_float(xr[c]));
    m = block_max(m, red);
    float s = 0.f;
    for (i64 c = threadIdx.x; c < v; c += blockDim.x) s += expf(to_float(xr[c]) - m);
    const float lse = m + logf(block_sum(s, red));
    for (i64 c = threadIdx.x; c < v; c += blockDim.x) logp[row * v + c] = to_float(xr[c]) - lse;
  }
}

extern "C" __global__ void ce_naive_loss(float* __restrict__ loss_rows,
                                         const float* __restrict__ logp,
                                         const TG* __restrict__ tgt, i64 n, i64 v, i64 ignore,
                                         float smoothing) {
  __shared__ float red[64];
  for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
    const i64 t = (i64)tgt[row];
    bool ignored;
    const bool ok = target_ok(t, v, ignore, ignored);
    float s = 0.f;
    if (smoothing > 0.f && ok && !ignored)
      for (i64 c = threadIdx.x; c < v; c += blockDim.x) s += logp[row * v + c];
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
      float l;
      if (!ok) l = f_nan();
      else if (ignored) l = 0.f;
      else l = -(1.f - smoothing) * logp[row * v + t] - smoothing / (float)v * s;
      loss_rows[row] = l;
    }
  }
}

extern "C" __global__ void ce_naive_grad(T* __restrict__ dx, const float* __restrict__ logp,
                                         const TG* __restrict__ tgt, const Status* status, i64 n,
                                         i64 v, i64 ld, i64 ignore, float smoothing, float dloss,
                                         int mean) {
  const float scale = grad_scale(status, dloss, mean);
  const float off = smoothing / (float)v;
  for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
    const i64 t = (i64)tgt[row];
    bool ignored;
    const bool ok = target_ok(t, v, ignore, ignored);
    for (i64 c = threadIdx.x; c < v; c += blockDim.x) {
      float g;
      if (!ok) g = f_nan();
      else if (ignored) g = 0.f;
      else g = scale * (expf(logp[row * v + c]) - off - (c == t ? 1.f - smoothing : 0.f));
      dx[row * ld + c] = from_float<T>(g);
    }
  }
}

// ---------------------------------------------------------------- fused (CUDA `fused`)

// Running (max, Σ 2^(y−max)) of one thread, in log2 units, updated once per vector.
// A row the loss skips (ignored target: loss and gradient 0) or cannot take (target out of range:
// NaN, the documented unchecked behaviour): every thread of the block calls it.
// `ce_cluster` writes its block's share [c0, c1) of the row, the loss from one block only.
__device__ __forceinline__ void write_skipped_range(T* dx, float* loss_rows, i64 row, i64 ld, bool ok,
                                                    i64 c0, i64 c1, bool writes_loss) {
  const float g = ok ? 0.f : f_nan();
  if (writes_loss && threadIdx.x == 0) loss_rows[row] = g;
  if (dx) {
    T* gr = dx + row * ld;
    for (i64 c = c0 + threadIdx.x; c < c1; c += blockDim.x) gr[c] = from_float<T>(g);
  }
}
__device__ __forceinline__ void write_skipped_row(T* dx, float* loss_rows, i64 row, i64 v, i64 ld, bool ok) {
  write_skipped_range(dx, loss_rows, row, ld, ok, 0, v, true);
}

// Elements before a row's first 16-byte boundary (the scalar head; at most v).
__device__ __forceinline__ i64 row_head(const T* xr, i64 v) {
  const i64 head = (i64)(((16u - (unsigned)((u64)xr & 15u)) & 15u) / sizeof(T));
  return head > v ? v : head;
}

__device__ __forceinline__ void online_add(float& m, float& s, const float* y, int k) {
  float mv = y[0];
  for (int e = 1; e < k; ++e) mv = fmaxf(mv, y[e]);
  if (mv > m) {
    s *= exp2f(m - mv);
    m = mv;
  }
  for (int e = 0; e < k; ++e) s += exp2f(y[e] - m);
}

// `dx` may equal `x` (in place): no __restrict__ on either. `dx` is null when no gradient is
// wanted. Requires dx ≡ x (mod 16 bytes) so both rows split into the same head/vectors/tail.
extern "C" __global__ void ce_fused(T* dx, float* __restrict__ loss_rows, const T* x,
                                    const TG* __restrict__ tgt, const Status* status, i64 n, i64 v, i64 ld,
                                    i64 ignore, float smoothing, float dloss, int mean) {
  __shared__ float red[64];
  const float scale = dx ? grad_scale(status, dloss, mean) : 0.f;
  const float off = smoothing / (float)v;
  for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = x + row * ld;
    const i64 t = (i64)tgt[row];
    bool ignored;
    const bool ok = target_ok(t, v, ignore, ignored);
    // Every thread of the block takes the same branch (t is per row).
    if (!ok || ignored) {
      write_skipped_row(dx, loss_rows, row, v, ld, ok);
      continue;
    }
    // Target logit, read before the barriers below (in place, pass 2 overwrites it).
    const float xt = threadIdx.x == 0 ? to_float(xr[t]) : 0.f;

    // Split the row at 16-byte boundaries: a scalar head, whole vectors, a scalar tail.
    const i64 head = row_head(xr, v), nvec = (v - head) / VEC, tail = head + nvec * VEC;
    const Vec* xv = reinterpret_cast<const Vec*>(xr + head);

    float m = f_lowest(), s = 0.f, sx = 0.f;
    for (i64 c = threadIdx.x; c < head; c += blockDim.x) {
      const float xf = to_float(xr[c]);
      const float y = xf * LOG2E;
      sx += xf;
      online_add(m, s, &y, 1);
    }
#pragma unroll 4
    for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec a = xv[i];
      float y[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xf = to_float(a.v[e]);
        sx += xf;
        y[e] = xf * LOG2E;
      }
      online_add(m, s, y, VEC);
    }
    for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) {
      const float xf = to_float(xr[c]);
      const float y = xf * LOG2E;
      sx += xf;
      online_add(m, s, &y, 1);
    }
    const float M = block_max(m, red);
    const float2 tot = block_sum2(m == f_lowest() ? 0.f : s * exp2f(m - M), sx, red);
    const float inv_s = 1.f / tot.x;
    if (threadIdx.x == 0) {
      const float lse = (M + log2f(tot.x)) * LN2;
      // No smoothing: the other classes add nothing (a masked −inf logit would make the term
      // 0·(−inf) = NaN).
      loss_rows[row] = lse - (1.f - smoothing) * xt - (smoothing > 0.f ? off * tot.y : 0.f);
    }
    if (!dx) continue;

    // Pass 2: p_j = 2^(y_j − M) / S, dx = scale·(p − ε/V − (1−ε)[j = t]).
    T* gr = dx + row * ld;
    Vec* gv = reinterpret_cast<Vec*>(gr + head);
    const float hit = 1.f - smoothing;
    for (i64 c = threadIdx.x; c < head; c += blockDim.x) {
      const float p = exp2f(to_float(xr[c]) * LOG2E - M) * inv_s;
      gr[c] = from_float<T>(scale * (p - off - (c == t ? hit : 0.f)));
    }
#pragma unroll 4
    for (i64 i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec a = xv[i];
      const i64 c0 = head + i * VEC;
      Vec o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float p = exp2f(to_float(a.v[e]) * LOG2E - M) * inv_s;
        o.v[e] = from_float<T>(scale * (p - off - (c0 + e == t ? hit : 0.f)));
      }
      gv[i] = o;
    }
    for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) {
      const float p = exp2f(to_float(xr[c]) * LOG2E - M) * inv_s;
      gr[c] = from_float<T>(scale * (p - off - (c == t ? hit : 0.f)));
    }
  }
}

// ---------------------------------------------------------------- resident (CUDA `resident`)


// Pass 1 of one 16-byte vector: Σx, and the running (m, s) in log2 units with the max taken over
// the vector's raw values first (one rescale per vector).
__device__ __forceinline__ void resident_add_vec(float& m, float& s, float& sx, const Vec& a) {
  float xf[VEC];
  float mx = f_ninf();
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    xf[e] = to_float(a.v[e]);
    sx += xf[e];
    mx = fmaxf(mx, xf[e]);
  }
  const float mv = mx * LOG2E;
  if (mv > m) {
    s *= ex2_approx(m - mv);
    m = mv;
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) s += ex2_approx(fmaf(xf[e], LOG2E, -m));
}

// Pass 2 of one vector: dx_j = 2^(x_j·log2e − M)·pa − (pb, or pbh at the target's lane).
__device__ __forceinline__ Vec resident_grad_vec(const Vec a, float M, float pa, float pb, float pbh,
                                                 int target_lane) {
  Vec o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float q = ex2_approx(fmaf(to_float(a.v[e]), LOG2E, -M));
    o.v[e] = from_float<T>(fmaf(q, pa, -(e == target_lane ? pbh : pb)));
  }
  return o;
}

// Same contract as ce_fused, plus `cap`: the vectors of a row kept in dynamic shared memory
// (cap·16 bytes of it; 0 = none). Launched with ≤ 1024 threads; (1024, 2) keeps a 1024-thread
// block at ≤ 32 registers so two share an SM.
extern "C" __global__ void __launch_bounds__(1024, 2)
    ce_resident(T* dx, float* __restrict__ loss_rows, const T* x, const TG* __restrict__ tgt,
                const Status* status, i64 n, i64 v, i64 ld, i64 ignore, float smoothing, float dloss,
                int mean, i64 cap) {
  __shared__ float red[64];
  extern __shared__ __align__(16) unsigned char ce_smem[];
  Vec* sm = reinterpret_cast<Vec*>(ce_smem);
  const float scale = dx ? grad_scale(status, dloss, mean) : 0.f;
  const float off = smoothing / (float)v;
  for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = x + row * ld;
    const i64 t = (i64)tgt[row];
    bool ignored;
    const bool ok = target_ok(t, v, ignore, ignored);
    if (!ok || ignored) {
      write_skipped_row(dx, loss_rows, row, v, ld, ok);
      continue;
    }
    const float xt = threadIdx.x == 0 ? to_float(xr[t]) : 0.f;
    const i64 head = row_head(xr, v), nvec = (v - head) / VEC, tail = head + nvec * VEC;
    const Vec* xv = reinterpret_cast<const Vec*>(xr + head);

    // Pass 1: running (m, s) in log2 units, m = max of x·log2e so far.
    // Vectors below `lim` are kept in shared memory. They go there by cp.async, all of the
    // thread's vectors of the row issued at once, and are read back from shared memory once
    // landed (each thread reads only what it copied: no barrier). Loaded into registers, at most
    // ~2 were in flight per thread under the 32-register cap, and pass 1 waited on them: in the
    // per-SASS profile (docs/cross_entropy.md, "Pass 1 by cp.async") 45% of the kernel's stall
    // samples were the bf16 unpacking right after those loads, 16% the reduction barrier behind
    // the slowest thread.
    const i64 lim = cap < nvec ? cap : nvec;
    i64 i = threadIdx.x;
#pragma unroll 4
    for (; i < lim; i += blockDim.x) cp_async16(&sm[i], &xv[i]);
    cp_async_commit();
    float m = f_lowest(), s = 0.f, sx = 0.f;
    auto add_vec = [&](const Vec& a) { resident_add_vec(m, s, sx, a); };
    for (i64 c = threadIdx.x; c < head; c += blockDim.x) {
      const float xf = to_float(xr[c]);
      const float y = xf * LOG2E;
      sx += xf;
      online_add(m, s, &y, 1);
    }
    // The vectors beyond shared memory, and the tail, while the copies land.
#pragma unroll 4
    for (; i < nvec; i += blockDim.x) add_vec(xv[i]);
    for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) {
      const float xf = to_float(xr[c]);
      const float y = xf * LOG2E;
      sx += xf;
      online_add(m, s, &y, 1);
    }
    cp_async_wait<0>();
#pragma unroll 1
    for (i = threadIdx.x; i < lim; i += blockDim.x) add_vec(sm[i]);
    const float M = block_max(m, red);
    const float2 tot = block_sum2(m == f_lowest() ? 0.f : s * exp2f(m - M), sx, red);
    const float inv_s = 1.f / tot.x;
    if (threadIdx.x == 0) {
      const float lse = (M + log2f(tot.x)) * LN2;
      // No smoothing: the other classes add nothing (a masked −inf logit would make the term
      // 0·(−inf) = NaN).
      loss_rows[row] = lse - (1.f - smoothing) * xt - (smoothing > 0.f ? off * tot.y : 0.f);
    }
    if (!dx) continue;

    // Pass 2: dx_j = 2^(x_j·log2e − M)·(scale/S) − scale·(ε/V + (1−ε)[j = t]).
    T* gr = dx + row * ld;
    Vec* gv = reinterpret_cast<Vec*>(gr + head);
    const float hit = 1.f - smoothing;
    for (i64 c = threadIdx.x; c < head; c += blockDim.x) {
      const float p = exp2f(to_float(xr[c]) * LOG2E - M) * inv_s;
      gr[c] = from_float<T>(scale * (p - off - (c == t ? hit : 0.f)));
    }
    const float pa = scale * inv_s, pb = scale * off, pbh = scale * (off + hit);
    // The target's vector index and lane (−1 when it is in the head or tail).
    const i64 tv = t >= head && t < tail ? (t - head) / VEC : -1;
    const int tl = (int)((t - head) & (VEC - 1));
    auto grad_vec = [&](i64 i, const Vec& a) {
      gv[i] = resident_grad_vec(a, M, pa, pb, pbh, i == tv ? tl : -1);
    };
    i = threadIdx.x;
    // Not unrolled: shared-memory reads need no loads in flight to hide latency, and unrolled
    // (4 or 8) this loop spilled the 16-bit variants under the 32-register cap at sm_90a.
#pragma unroll 1
    for (; i < lim; i += blockDim.x) grad_vec(i, sm[i]);
#pragma unroll 4
    for (; i < nvec; i += blockDim.x) grad_vec(i, xv[i]);
    for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) {
      const float p = exp2f(to_float(xr[c]) * LOG2E - M) * inv_s;
      gr[c] = from_float<T>(scale * (p - off - (c == t ? hit : 0.f)));
    }
  }
}

// ---------------------------------------------------------------- cluster (CUDA `cluster`, sm_90)
// -DFE_CLUSTER=C (2, 4 or 8): a row is split over the C blocks of a thread-block cluster. Block
// `rank` keeps its contiguous share of the row's 16-byte vectors in its shared memory (rank 0
// also takes the scalar head, rank C−1 the tail), so a row of any size up to C × ~227 KiB is
// on chip once (resident keeps at most one block's ~227 KiB of it) and each SM holds shares of
// several rows, whose pass 1 → reductions → pass 2 turnarounds overlap one another (resident:
// 1–2 rows per SM). The blocks exchange their (max, Σ2^(y−max), Σx) through distributed shared
// memory: each writes its partial into its own slot, one cluster barrier, then every thread
// reads the C slots (mapa + ld.shared::cluster) and combines them in rank order (the same bits
// on every run). Slots alternate by parity between consecutive rows: a block rewrites a slot
// only after the next row's barrier, which each block reaches after reading the slot. In place
// works as in ce_resident: rank 0 reads the target logit before the barrier, and every block
// writes dx only after it.
#if defined(FE_CLUSTER) && FE_CLUSTER > 1
#include "hopper.cuh"
// The aligned form of hopper.cuh's cluster_sync: every thread of each warp arrives together here.
__device__ __forceinline__ void ce_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}
// The float4 at `local` in block `rank`'s shared memory.
__device__ __forceinline__ float4 ce_ld_cluster(const float4* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// Same contract as ce_resident, with `per` = vectors of a row per block (⌈vectors / C⌉; the
// dynamic shared memory holds per × 16 bytes). Grid: a multiple of C blocks. (640, 2): ≤ 48
// registers, no spills (at 32 — resident's (1024, 2) — the 64-bit row bookkeeping spilled;
// the host plans at most 1280 threads per SM).

extern "C" __global__ void __cluster_dims__(FE_CLUSTER, 1, 1) __launch_bounds__(640, 2)
    ce_cluster(T* dx, float* __restrict__ loss_rows, const T* x, const TG* __restrict__ tgt,
               const Status* status, i64 n, i64 v, i64 ld, i64 ignore, float smoothing, float dloss, int mean,
               i64 per) {
  constexpr unsigned C = FE_CLUSTER;
  __shared__ float red[64];
  __shared__ float4 slot[2];  // this block's (max, Σ, Σx) of the rows of each parity
  extern __shared__ __align__(16) unsigned char ce_smem[];
  Vec* sm = reinterpret_cast<Vec*>(ce_smem);
  const unsigned rank = cluster_rank();
  const float scale = dx ? grad_scale(status, dloss, mean) : 0.f;
  const float off = smoothing / (float)v;
  int parity = 0;
  for (i64 row = blockIdx.x / C; row < n; row += gridDim.x / C) {
    const T* xr = x + row * ld;
    const i64 t = (i64)tgt[row];
    const i64 head = row_head(xr, v), nvec = (v - head) / VEC, tail = head + nvec * VEC;
    // This block's vectors [v0, v1) and elements [c0, c1) of the row.
    const i64 v0 = min((i64)rank * per, nvec), v1 = min(v0 + per, nvec);
    const i64 c0 = rank == 0 ? 0 : head + v0 * VEC, c1 = rank == C - 1 ? v : head + v1 * VEC;
    bool ignored;
    const bool ok = target_ok(t, v, ignore, ignored);
    if (!ok || ignored) {  // the same branch in every block of the cluster: no barrier skipped
      write_skipped_range(dx, loss_rows, row, ld, ok, c0, c1, rank == 0);
      continue;
    }
    const float xt = (rank == 0 && threadIdx.x == 0) ? to_float(xr[t]) : 0.f;
    const Vec* xv = reinterpret_cast<const Vec*>(xr + head);

    // The block's share of the row into shared memory by cp.async, all at once (as ce_resident).
#pragma unroll 4
    for (i64 i = v0 + threadIdx.x; i < v1; i += blockDim.x) cp_async16(&sm[i - v0], &xv[i]);
    cp_async_commit();
    float m = f_lowest(), s = 0.f, sx = 0.f;
    auto add_scalar = [&](i64 c) {
      const float xf = to_float(xr[c]);
      const float y = xf * LOG2E;
      sx += xf;
      online_add(m, s, &y, 1);
    };
    if (rank == 0)
      for (i64 c = threadIdx.x; c < head; c += blockDim.x) add_scalar(c);
    if (rank == C - 1)
      for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) add_scalar(c);
    cp_async_wait<0>();
#pragma unroll 1
    for (i64 i = v0 + threadIdx.x; i < v1; i += blockDim.x) resident_add_vec(m, s, sx, sm[i - v0]);
    const float Mb = block_max(m, red);
    const float2 tb = block_sum2(m == f_lowest() ? 0.f : s * exp2f(m - Mb), sx, red);
    if (threadIdx.x == 0) slot[parity] = make_float4(Mb, tb.x, tb.y, 0.f);
    ce_cluster_sync();
    // Combined in rank order, online (a running max and a rescaled sum: no array of C partials,
    // which spilled at 32 registers).
    float M = f_lowest(), S = 0.f, SX = 0.f;
#pragma unroll
    for (unsigned r = 0; r < C; ++r) {
      const float4 q = ce_ld_cluster(&slot[parity], r);
      if (q.x > M) {
        S *= exp2f(M - q.x);
        M = q.x;
      }
      if (q.x != f_lowest()) S += q.y * exp2f(q.x - M);
      SX += q.z;
    }
    parity ^= 1;
    const float inv_s = 1.f / S;
    if (rank == 0 && threadIdx.x == 0) {
      const float lse = (M + log2f(S)) * LN2;
      loss_rows[row] = lse - (1.f - smoothing) * xt - (smoothing > 0.f ? off * SX : 0.f);
    }
    if (!dx) continue;

    T* gr = dx + row * ld;
    Vec* gv = reinterpret_cast<Vec*>(gr + head);
    const float hit = 1.f - smoothing;
    auto grad_scalar = [&](i64 c) {
      const float p = exp2f(to_float(xr[c]) * LOG2E - M) * inv_s;
      gr[c] = from_float<T>(scale * (p - off - (c == t ? hit : 0.f)));
    };
    if (rank == 0)
      for (i64 c = threadIdx.x; c < head; c += blockDim.x) grad_scalar(c);
    const float pa = scale * inv_s, pb = scale * off, pbh = scale * (off + hit);
    const i64 tv = t >= head && t < tail ? (t - head) / VEC : -1;
    const int tl = (int)((t - head) & (VEC - 1));
#pragma unroll 4
    for (i64 i = v0 + threadIdx.x; i < v1; i += blockDim.x)
      gv[i] = resident_grad_vec(sm[i - v0], M, pa, pb, pbh, i == tv ? tl : -1);
    if (rank == C - 1)
      for (i64 c = tail + threadIdx.x; c < v; c += blockDim.x) grad_scalar(c);
  }
  ce_cluster_sync();  // no block exits while a peer may still read its slots
}
#endif

// ---------------------------------------------------------------- scalar loss

// One block; per-thread partial sums in f64, a fixed order, so the same bits on every run.
extern "C" __global__ void ce_reduce(float* __restrict__ loss, const float* __restrict__ loss_rows,
                                     const Status* status, i64 n, int mean) {
  __shared__ double red[32];
  double s = 0.0;
  for (i64 r = threadIdx.x; r < n; r += blockDim.x) s += (double)loss_rows[r];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
    for (int w = 0; w < nw; ++w) tot += red[w];
    // 0/0 = NaN when every row is ignored, as torch.
    loss[0] = (float)(mean ? tot / (double)status->count : tot);
  }
}

// ce_scale_grad — the loss's incoming gradient folded into dlogits after the fact, in place:
// g[r, c] *= dloss[per_row ? r : 0], dloss in g's dtype on the device (so no host sync). The
// forward computes dlogits before autograd knows dloss; `loss.backward()` on the loss as is
// brings dloss = 1, and then every thread returns after one cached read: no pass over dlogits.
// Rows are `ld` elements apart (ld ≥ cols: dlogits in padded rows). `vec`: cols and ld whole
// numbers of 16-byte vectors and g 16-byte aligned (16-byte loads/stores).
extern "C" __global__ void ce_scale_grad(T* __restrict__ g, const T* __restrict__ dloss, i64 rows,
                                         i64 cols, i64 ld, int per_row, int vec) {
  if (!per_row && to_float(dloss[0]) == 1.f) return;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    typedef Vec16<T> V;
    constexpr int N = V::N;
    const i64 vrow = cols / N, vld = ld / N, nv = rows * vrow;
    V* gv = reinterpret_cast<V*>(g);
    for (i64 i = first; i < nv; i += stride) {
      const i64 r = i / vrow;
      const float s = to_float(dloss[per_row ? r : 0]);
      V* p = gv + r * vld + (i - r * vrow);
      V a = *p;
#pragma unroll
      for (int k = 0; k < N; ++k) a.v[k] = from_float<T>(to_float(a.v[k]) * s);
      *p = a;
    }
    return;
  }
  for (i64 i = first; i < rows * cols; i += stride) {
    const i64 r = i / cols;
    T* p = g + r * ld + (i - r * cols);
    *p = from_float<T>(to_float(*p) * to_float(dloss[per_row ? r : 0]));
  }
}
