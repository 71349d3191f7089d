// activation — y = dropout(act(x + b)) and the gated linear units out = act(gate) ⊙ up, forward
// and backward.
//
// Specialisation: -DFE_ELEM=<storage type>, -DFE_ACT=<0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf,
// 4 silu>. Arithmetic in fp32. Dropout draws Philox4x32-10 (philox.cuh): element i of the
// tensor takes the 16-bit half i%2 (low first) of word (i/2)%4 of the block at counter
// offset + i/8, kept when that draw < thr (thr < 2¹⁶, an integer compare), kept values scaled by
// `scale` = 1/(1−p). The backward redraws the same mask from (seed, offset) instead of reading a
// stored one.
//
// step 1 — naive (unfused): one scalar kernel per op, as an eager framework runs it: bias add,
//   activation, dropout (and for the GLU: activation, multiply), each reading and writing a
//   full tensor in the storage dtype. Forward bias+act+dropout moves ~6 tensors' worth of bytes
//   for a 2-tensor job (x→h, h→a, a→y); the backward ~8 plus a column sum for db.
// step 2 — fused: one pass. A thread owns one 16-byte column vector (its bias vector stays in
//   registers) and walks rows gridDim.y apart, UNROLL rows' loads in flight before any compute
//   (entries _u1, _u2, _u4; the host times them at first use: more rows in flight hide more
//   latency but cost registers, and so resident blocks);
//   the dropout mask comes from one Philox block per 8 elements (16-bit draws: a 16-byte vector
//   of a 16-bit dtype is one whole block; an f32 vector half of one). Forward moves x in, y out:
//   a copy's traffic. The backward
//   adds db: each block accumulates its column vector over its rows in registers and writes one
//   fp32 partial row; act_col_sum adds the partials in a fixed order (deterministic, no
//   atomics: the same bits on every run on the same GPU).
//   Per-element instruction budget (docs/activation.md): at bf16, 3.0 TB/s and 132 SMs at
//   ~1.7 GHz, the forward has ~0.30 SM-cycles = ~38 issue slots (128 lanes/cycle) per element,
//   the backward ~57. Measured from SASS, the first fused build spent ~33 slots per element on
//   bias + GELU (IEEE expf and a division with a slow-path call) and ~14 on Philox (one block
//   per 4 elements, 32-bit draws): issue-bound, 63% / 75% of copy. Now: ex2.approx + rcp.approx for the
//   sigmoid (≤ 4·10⁻⁷ relative, far below the f32 check's 5·10⁻⁶; 16-bit storage rounds at
//   4·10⁻³) and one Philox block per 8 elements, with the 16-bit compare done on whole words.

#include "ferrite.cuh"
#include "philox.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
#ifndef FE_ACT
#define FE_ACT 0
#endif

typedef FE_ELEM T;
typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;

#include "act.cuh"

// a = act(h) and d = act'(h) for this module's activation.
__device__ __forceinline__ void act_fg(float h, float& a, float& d) { act_fg_of<FE_ACT>(h, a, d); }

__device__ __forceinline__ float act_f(float h) {
  float a, d;
  act_fg(h, a, d);
  return a;
}

__device__ __forceinline__ float act_grad(float h) {
  float a, d;
  act_fg(h, a, d);
  return d;
}

__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }
__device__ __forceinline__ i64 global_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }

// Whether element i of the stream (seed, offset) is kept (thr: the 16-bit threshold).
__device__ __forceinline__ bool keep_scalar(u64 seed, u64 offset, i64 i, unsigned int thr) {
  const Philox4 r = philox4x32_10(offset + (u64)i / 8, seed);
  const int w = (int)((i >> 1) & 3);
  // A select chain, not r.w[w]: a dynamic index would put the block in local memory.
  const unsigned int v = w == 0 ? r.w[0] : w == 1 ? r.w[1] : w == 2 ? r.w[2] : r.w[3];
  return philox_keep16(v, i & 1, thr << 16);
}

// ---------------------------------------------------------------- step 1: naive (unfused) ----

// h = x + b[col] (rows × cols, contiguous).
extern "C" __global__ void act_bias_add_naive(T* __restrict__ h, const T* __restrict__ x,
                                              const T* __restrict__ b, i64 rows, i64 cols) {
  const i64 n = rows * cols;
  for (i64 i = global_thread(); i < n; i += grid_threads())
    h[i] = from_float<T>(to_float(x[i]) + to_float(b[i % cols]));
}

// out[r, j] = act(in[r, j]) over rows × n, rows `ldo` / `ldi` elements apart.
extern "C" __global__ void act_apply_naive(T* __restrict__ out, i64 ldo, const T* __restrict__ in,
                                           i64 ldi, i64 rows, i64 n) {
  const i64 total = rows * n;
  for (i64 i = global_thread(); i < total; i += grid_threads()) {
    const i64 r = i / n, j = i - r * n;
    out[r * ldo + j] = from_float<T>(act_f(to_float(in[r * ldi + j])));
  }
}

// out[r, j] = g[r, j] · act'(h[r, j]).
extern "C" __global__ void act_grad_naive(T* __restrict__ out, i64 ldo, const T* __restrict__ g,
                                          i64 ldg, const T* __restrict__ h, i64 ldh, i64 rows,
                                          i64 n) {
  const i64 total = rows * n;
  for (i64 i = global_thread(); i < total; i += grid_threads()) {
    const i64 r = i / n, j = i - r * n;
    out[r * ldo + j] = from_float<T>(to_float(g[r * ldg + j]) * act_grad(to_float(h[r * ldh + j])));
  }
}

// out[r, j] = a[r, j] · b[r, j].
extern "C" __global__ void act_mul_naive(T* __restrict__ out, i64 ldo, const T* __restrict__ a,
                                         i64 lda, const T* __restrict__ b, i64 ldb, i64 rows,
                                         i64 n) {
  const i64 total = rows * n;
  for (i64 i = global_thread(); i < total; i += grid_threads()) {
    const i64 r = i / n, j = i - r * n;
    out[r * ldo + j] = from_float<T>(to_float(a[r * lda + j]) * to_float(b[r * ldb + j]));
  }
}

// out[i] = keep(i) ? in[i]·scale : 0 over n contiguous elements: dropout's forward, and (the
// same mask, the same scale) its backward.
extern "C" __global__ void act_dropout_naive(T* __restrict__ out, const T* __restrict__ in, i64 n,
                                             u64 seed, u64 offset, unsigned int thr, float scale) {
  for (i64 i = global_thread(); i < n; i += grid_threads())
    out[i] = from_float<T>(keep_scalar(seed, offset, i, thr) ? to_float(in[i]) * scale : 0.f);
}

// db[c] = Σ_r dx[r, c] in row order, one thread per column (the stored, rounded dx).
extern "C" __global__ void act_col_sum_naive(T* __restrict__ db, const T* __restrict__ dx, i64 rows,
                                             i64 cols) {
  const i64 c = global_thread();
  if (c >= cols) return;
  float s = 0.f;
  for (i64 r = 0; r < rows; ++r) s += to_float(dx[r * cols + c]);
  db[c] = from_float<T>(s);
}

// ------------------------------------------------------------------------ step 2: fused ------

// Applies the mask of the 16-byte vector starting at element i0 (a multiple of VEC) to o. One
// Philox block covers 8 elements: all of a 16-bit vector; for f32 (VEC = 4) words 0–1 or 2–3.
__device__ __forceinline__ void apply_dropout(float (&o)[VEC], i64 i0, u64 seed, u64 offset,
                                              unsigned int thr, float scale) {
  static_assert(VEC == 8 || VEC == 4, "16-byte vectors of 2- or 4-byte elements");
  const unsigned int T = thr << 16;
  const Philox4 r = philox4x32_10(offset + (u64)i0 / 8, seed);
  unsigned int w[VEC / 2];
  if constexpr (VEC == 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = r.w[j];
  } else {
    const bool upper = (i0 >> 2) & 1;
    w[0] = upper ? r.w[2] : r.w[0];
    w[1] = upper ? r.w[3] : r.w[1];
  }
  // A select, not a multiply by 0: a dropped element is 0 even where o is inf or NaN.
#pragma unroll
  for (int e = 0; e < VEC; ++e) o[e] = philox_keep16(w[e / 2], e & 1, T) ? o[e] * scale : 0.f;
}

__device__ __forceinline__ void load_bias(float (&bias)[VEC], const T* b, i64 v) {
  if (b) {
    const Vec bv = reinterpret_cast<const Vec*>(b)[v];
#pragma unroll
    for (int e = 0; e < VEC; ++e) bias[e] = to_float(bv.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) bias[e] = 0.f;
  }
}

// y = dropout(act(x + b)). Requires cols % VEC == 0 and 16-byte aligned x, y, b. Grid: x over
// column vectors (blockDim.x each), y over row groups; `dropout` = 0 skips the RNG (p = 0).
template <int UNROLL>
__device__ __forceinline__ void act_fwd_fused_body(T* __restrict__ y, const T* __restrict__ x,
                                         const T* __restrict__ b, i64 rows, i64 cols, u64 seed,
                                         u64 offset, unsigned int thr, float scale, int dropout) {
  const i64 nvec = cols / VEC;
  const i64 v = global_thread();
  if (v >= nvec) return;
  float bias[VEC];
  load_bias(bias, b, v);
  const i64 G = gridDim.y;
  for (i64 r0 = blockIdx.y; r0 < rows; r0 += G * UNROLL) {
    Vec xv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) xv[k] = reinterpret_cast<const Vec*>(x + r * cols)[v];
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = act_f(to_float(xv[k].v[e]) + bias[e]);
        if (dropout) apply_dropout(o, r * cols + v * VEC, seed, offset, thr, scale);
        Vec out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) out.v[e] = from_float<T>(o[e]);
        reinterpret_cast<Vec*>(y + r * cols)[v] = out;
      }
    }
  }
}
extern "C" __global__ void act_fwd_fused_u1(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_fwd_fused_body<1>(y, x, b, rows, cols, seed, offset, thr, scale, dropout);
}
extern "C" __global__ void act_fwd_fused_u2(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_fwd_fused_body<2>(y, x, b, rows, cols, seed, offset, thr, scale, dropout);
}
extern "C" __global__ void act_fwd_fused_u4(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_fwd_fused_body<4>(y, x, b, rows, cols, seed, offset, thr, scale, dropout);
}

// dx = dy · mask·scale · act'(x + b); db partials: db_part[blockIdx.y, c] = Σ over this block's
// rows of dx[r, c] (unrounded fp32), or nothing when db_part is null.
template <int UNROLL>
__device__ __forceinline__ void act_bwd_fused_body(T* __restrict__ dx, float* __restrict__ db_part,
                                         const T* __restrict__ dy, const T* __restrict__ x,
                                         const T* __restrict__ b, i64 rows, i64 cols, u64 seed,
                                         u64 offset, unsigned int thr, float scale, int dropout) {
  const i64 nvec = cols / VEC;
  const i64 v = global_thread();
  if (v >= nvec) return;
  float bias[VEC], acc[VEC];
  load_bias(bias, b, v);
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  const i64 G = gridDim.y;
  for (i64 r0 = blockIdx.y; r0 < rows; r0 += G * UNROLL) {
    Vec xv[UNROLL], gv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        xv[k] = reinterpret_cast<const Vec*>(x + r * cols)[v];
        gv[k] = reinterpret_cast<const Vec*>(dy + r * cols)[v];
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        float g[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[e] = to_float(gv[k].v[e]);
        if (dropout) apply_dropout(g, r * cols + v * VEC, seed, offset, thr, scale);
        Vec out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = g[e] * act_grad(to_float(xv[k].v[e]) + bias[e]);
          acc[e] += d;
          out.v[e] = from_float<T>(d);
        }
        reinterpret_cast<Vec*>(dx + r * cols)[v] = out;
      }
    }
  }
  if (db_part) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) db_part[blockIdx.y * cols + v * VEC + e] = acc[e];
  }
}
extern "C" __global__ void act_bwd_fused_u1(T* __restrict__ dx, float* __restrict__ db_part, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_bwd_fused_body<1>(dx, db_part, dy, x, b, rows, cols, seed, offset, thr, scale, dropout);
}
extern "C" __global__ void act_bwd_fused_u2(T* __restrict__ dx, float* __restrict__ db_part, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_bwd_fused_body<2>(dx, db_part, dy, x, b, rows, cols, seed, offset, thr, scale, dropout);
}
extern "C" __global__ void act_bwd_fused_u4(T* __restrict__ dx, float* __restrict__ db_part, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ b, i64 rows, i64 cols, u64 seed, u64 offset, unsigned int thr, float scale, int dropout) {
  act_bwd_fused_body<4>(dx, db_part, dy, x, b, rows, cols, seed, offset, thr, scale, dropout);
}

// db[c] = Σ_p part[p, c] over `parts` partial rows (~330 on an H100), in a fixed order.
extern "C" __global__ void act_col_sum(T* __restrict__ db, const float* __restrict__ part,
                                       i64 parts, i64 cols) {
  col_sum_fixed_order(db, part, parts, cols);
}

// GLU: in [rows, 2n] = (gate | up), out [rows, n] = act(gate) ⊙ up. Requires n % VEC == 0 and
// 16-byte aligned in, out. Same grid as act_fwd_fused.
template <int UNROLL>
__device__ __forceinline__ void glu_fwd_fused_body(T* __restrict__ out, const T* __restrict__ in, i64 rows,
                                         i64 n) {
  const i64 nvec = n / VEC;
  const i64 v = global_thread();
  if (v >= nvec) return;
  const i64 G = gridDim.y;
  for (i64 r0 = blockIdx.y; r0 < rows; r0 += G * UNROLL) {
    Vec gv[UNROLL], uv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        gv[k] = reinterpret_cast<const Vec*>(in + r * 2 * n)[v];
        uv[k] = reinterpret_cast<const Vec*>(in + r * 2 * n + n)[v];
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        Vec o;
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          o.v[e] = from_float<T>(act_f(to_float(gv[k].v[e])) * to_float(uv[k].v[e]));
        reinterpret_cast<Vec*>(out + r * n)[v] = o;
      }
    }
  }
}
extern "C" __global__ void glu_fwd_fused_u1(T* __restrict__ out, const T* __restrict__ in, i64 rows, i64 n) {
  glu_fwd_fused_body<1>(out, in, rows, n);
}
extern "C" __global__ void glu_fwd_fused_u2(T* __restrict__ out, const T* __restrict__ in, i64 rows, i64 n) {
  glu_fwd_fused_body<2>(out, in, rows, n);
}
extern "C" __global__ void glu_fwd_fused_u4(T* __restrict__ out, const T* __restrict__ in, i64 rows, i64 n) {
  glu_fwd_fused_body<4>(out, in, rows, n);
}

// d(gate) = dout · up · act'(gate), d(up) = dout · act(gate), into din [rows, 2n].
template <int UNROLL>
__device__ __forceinline__ void glu_bwd_fused_body(T* __restrict__ din, const T* __restrict__ dout,
                                         const T* __restrict__ in, i64 rows, i64 n) {
  const i64 nvec = n / VEC;
  const i64 v = global_thread();
  if (v >= nvec) return;
  const i64 G = gridDim.y;
  for (i64 r0 = blockIdx.y; r0 < rows; r0 += G * UNROLL) {
    Vec gv[UNROLL], uv[UNROLL], dv[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        gv[k] = reinterpret_cast<const Vec*>(in + r * 2 * n)[v];
        uv[k] = reinterpret_cast<const Vec*>(in + r * 2 * n + n)[v];
        dv[k] = reinterpret_cast<const Vec*>(dout + r * n)[v];
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 r = r0 + k * G;
      if (r < rows) {
        Vec dg, du;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float a, d;
          act_fg(to_float(gv[k].v[e]), a, d);
          const float g = to_float(dv[k].v[e]);
          dg.v[e] = from_float<T>(g * to_float(uv[k].v[e]) * d);
          du.v[e] = from_float<T>(g * a);
        }
        reinterpret_cast<Vec*>(din + r * 2 * n)[v] = dg;
        reinterpret_cast<Vec*>(din + r * 2 * n + n)[v] = du;
      }
    }
  }
}
extern "C" __global__ void glu_bwd_fused_u1(T* __restrict__ din, const T* __restrict__ dout, const T* __restrict__ in, i64 rows, i64 n) {
  glu_bwd_fused_body<1>(din, dout, in, rows, n);
}
extern "C" __global__ void glu_bwd_fused_u2(T* __restrict__ din, const T* __restrict__ dout, const T* __restrict__ in, i64 rows, i64 n) {
  glu_bwd_fused_body<2>(din, dout, in, rows, n);
}
extern "C" __global__ void glu_bwd_fused_u4(T* __restrict__ din, const T* __restrict__ dout, const T* __restrict__ in, i64 rows, i64 n) {
  glu_bwd_fused_body<4>(din, dout, in, rows, n);
}
