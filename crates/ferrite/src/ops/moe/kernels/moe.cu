// moe — the routing and data-movement kernels of a mixture-of-experts layer; the expert GEMMs
// are matmul's grouped kernels (wgmma.cu / mma.cu with -DFE_GROUPED), the SwiGLU activation's
// the activation family's glu.
//
// Specialisation: -DFE_ELEM=<activation storage type>. Routing arithmetic is fp32.
//
// The padded expert-contiguous layout every kernel here shares: expert e owns rows
// [ends[e-1], ends[e]) of the permuted buffers, its kept tokens first (in token order, slot order
// within a token: deterministic), then zero rows up to a multiple of ALIGN = 128. So every
// 128-row tile of the grouped GEMMs belongs to one expert (full TMA stores) and the weight
// gradient's k slices never straddle two experts; the padding costs at most ALIGN − 1 rows per
// expert. Rows past ends[E-1] are never read. Everything is sized for the worst case on the host
// (T·k + E·(ALIGN − 1) rows) and sized exactly on the device, so a step never waits for the host.
//
// Pipeline (forward): moe_router (one warp per token: scores, group-limited top-k, weights,
// probabilities for the auxiliary loss, logsumexp for the z-loss) → moe_chunk_hist (per-chunk
// expert histograms) → moe_plan (one block: per-chunk bases, counts, capacity, padded ends) →
// moe_scatter (each (token, slot) pair's row: stable rank inside its expert, dropped beyond the
// capacity) → moe_spread_rows (x into the layout by token, zero the padding) → grouped GEMMs →
// moe_combine (out[t] = Σ_j w[t,j]·y[pos[t,j]], fixed order, no atomics).
// Backward: moe_spread_rows (dout's rows in the layout, unscaled: the gate weights are applied
// by moe_glu_bwd, which is what lets the gates' gradient come from the down projection's dX GEMM
// instead of from a saved copy of y), the down projection's dX GEMM,
// moe_glu_bwd (the GLU backward with the gates folded in, and the gates' gradients), grouped GEMMs,
// moe_unpermute_grad (dx[t] = Σ_j dxp[pos[t,j]]), moe_router_bwd (dlogits through the
// renormalisation, the scoring function, the auxiliary and z-losses), moe_stats_* (the losses).

#include "ferrite.cuh"
#include "act.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
typedef FE_ELEM T;

constexpr int ALIGN = 128;
#define NEG_INF __int_as_float(0xff800000)
// Pairs per block of the histogram / scatter kernels.
constexpr int CHUNK = 2048;
constexpr int SCATTER_THREADS = 256;
constexpr int SCATTER_WARPS = SCATTER_THREADS / 32;

// Selection key: NaN ranks below every number (a NaN logit is never preferred), ties to the
// lower index.
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return !an && bn ? true : (an && bn ? ia < ib : false);
  return a > b || (a == b && ia < ib);
}

// Warp argmax of (key, index) pairs.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(v2, i2, v, i)) {
      v = v2;
      i = i2;
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One warp per token. score: 0 softmax over all experts, 1 sigmoid. Experts are split into
// n_group groups of E/n_group; with topk_group < n_group only the topk_group groups of largest
// group score (the sum of its two best scores, one when groups have one expert) are eligible
// (DeepSeek-V3's group-limited routing). The k eligible experts of largest score are chosen
// (largest first; selection compares logits, which order softmax and sigmoid scores alike and
// are exact), their weights are the scores, renormalised to sum 1 when renorm, times scale. A
// token with a NaN logit gets NaN weights (its output is then NaN: never silently routed).
// Outputs: idx / w [T][k], probs [T][E] (the scores), lse [T] (logsumexp of the logits).
// Shared memory: 2·E floats per warp (logits, then keys).
extern "C" __global__ void __launch_bounds__(128)
    moe_router(const T* __restrict__ logits, i64 ld, int ntok, int E, int k, int score, int renorm,
               int n_group, int topk_group, float scale, int* __restrict__ idx,
               float* __restrict__ w, float* __restrict__ probs, float* __restrict__ lse) {
  extern __shared__ float smem_f[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sc = smem_f + warp * 2 * E;  // scores
  float* key = sc + E;                // selection keys (logits; -inf when ineligible)
  for (i64 t = (i64)blockIdx.x * 4 + warp; t < ntok; t += (i64)gridDim.x * 4) {
    const T* row = logits + t * ld;
    float mx = NEG_INF;
    bool nan = false;
    for (int e = lane; e < E; e += 32) {
      const float x = to_float(row[e]);
      key[e] = x;
      nan |= x != x;
      mx = fmaxf(mx, x);
    }
    mx = warp_max(mx);
    nan = __any_sync(0xffffffffu, nan);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += __expf(key[e] - mx);
    sum = warp_sum(sum);
    const float l = mx + __logf(sum);
    for (int e = lane; e < E; e += 32) {
      const float x = key[e];
      sc[e] = score == 0 ? __expf(x - l) : 1.f / (1.f + __expf(-x));
    }
    __syncwarp();
    // Bit b of `blocked`: expert lane + 32·b is ineligible (group-limited) or already chosen.
    unsigned blocked = 0;
    if (topk_group < n_group) {
      // Group scores (lane g: group g; n_group ≤ 32), then the topk_group best groups.
      const int gs = E / n_group;
      float gscore = NEG_INF;
      if (lane < n_group) {
        float b1 = NEG_INF, b2 = NEG_INF;
        for (int e = lane * gs; e < (lane + 1) * gs; ++e) {
          const float s = sc[e] != sc[e] ? NEG_INF : sc[e];
          if (s > b1) {
            b2 = b1;
            b1 = s;
          } else if (s > b2) {
            b2 = s;
          }
        }
        gscore = gs > 1 ? b1 + b2 : b1;
      }
      bool keep = false;
      for (int r = 0; r < topk_group; ++r) {
        float v = lane < n_group && !keep ? gscore : __int_as_float(0x7fc00000);
        int i = lane < n_group && !keep ? lane : 0x7fffffff;
        warp_best(v, i);
        if (lane == i) keep = true;
      }
      const unsigned kept = __ballot_sync(0xffffffffu, keep);
      for (int e = lane, b = 0; e < E; e += 32, ++b)
        if (!((kept >> (e / gs)) & 1u)) blocked |= 1u << b;
    }
    // Top-k: k rounds of a warp argmax over the eligible experts not chosen yet (the host checks
    // k ≤ the eligible count, so every round finds one). "None" is (NaN, INT_MAX): it loses to
    // everything.
    int mine = -1;  // lane j < k keeps choice j
    float ssum = 0.f;
    for (int j = 0; j < k; ++j) {
      float v = __int_as_float(0x7fc00000);
      int i = 0x7fffffff;
      for (int e = lane, b = 0; e < E; e += 32, ++b)
        if (!((blocked >> b) & 1u) && better(key[e], e, v, i)) {
          v = key[e];
          i = e;
        }
      warp_best(v, i);
      if (lane == i % 32) blocked |= 1u << (i / 32);
      if (lane == j) mine = i;
      ssum += sc[i];
    }
    if (lane < k) {
      float wt = sc[mine];
      if (renorm) wt = wt / ssum;
      wt *= scale;
      if (nan) wt = __int_as_float(0x7fc00000);
      idx[t * k + lane] = mine;
      w[t * k + lane] = wt;
    }
    for (int e = lane; e < E; e += 32) probs[t * E + e] = sc[e];
    if (lane == 0) lse[t] = l;
    __syncwarp();
  }
}

extern "C" __global__ void moe_fill_i32(int* __restrict__ p, i64 n, int v) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    p[i] = v;
}

extern "C" __global__ void moe_zero_bytes(unsigned char* __restrict__ p, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    p[i] = 0;
}

// hist[c][e]: pairs of chunk c (CHUNK consecutive (token, slot) pairs) routed to expert e.
extern "C" __global__ void __launch_bounds__(SCATTER_THREADS)
    moe_chunk_hist(const int* __restrict__ idx, i64 pairs, int E, int* __restrict__ hist) {
  extern __shared__ int smem_i[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) smem_i[e] = 0;
  __syncthreads();
  const i64 c0 = (i64)blockIdx.x * CHUNK;
  for (int i = threadIdx.x; i < CHUNK && c0 + i < pairs; i += blockDim.x)
    atomicAdd(&smem_i[idx[c0 + i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(i64)blockIdx.x * E + e] = smem_i[e];
}

// One block of 1024 threads. base[c][e] = pairs of expert e in chunks before c; counts[e]; kept
// = min(count, cap) (cap < 0: dropless); ends[e] = Σ_{e' ≤ e} roundup(kept[e'], ALIGN);
// stats[0] = pairs dropped, stats[1] = rows used (ends[E-1]).
extern "C" __global__ void __launch_bounds__(1024)
    moe_plan(const int* __restrict__ hist, int chunks, int E, int cap, int* __restrict__ base,
             int* __restrict__ counts, int* __restrict__ ends, int* __restrict__ stats) {
  __shared__ int padded[1024];
  __shared__ int warp_tot[32];
  __shared__ int dropped;
  if (threadIdx.x == 0) dropped = 0;
  __syncthreads();
  const int e = threadIdx.x;
  int pad = 0;
  if (e < E) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      base[(i64)c * E + e] = run;
      run += hist[(i64)c * E + e];
    }
    counts[e] = run;
    const int kept = cap < 0 ? run : min(run, cap);
    pad = (kept + ALIGN - 1) / ALIGN * ALIGN;
    if (run > kept) atomicAdd(&dropped, run - kept);
  }
  // Inclusive scan of the padded lengths: within warps, then over the warp totals.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int v = pad;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_tot[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int s = warp_tot[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int u = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += u;
    }
    warp_tot[lane] = s;
  }
  __syncthreads();
  const int incl = v + (warp > 0 ? warp_tot[warp - 1] : 0);
  padded[threadIdx.x] = incl;
  if (e < E) ends[e] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    stats[0] = dropped;
    stats[1] = padded[E - 1];
  }
}

// pos[p]: the row of pair p in the layout (-1: dropped); src[row] = p for kept pairs (the caller
// fills src with -1 first: padding rows keep it). Within a chunk, pairs are ranked in order,
// SCATTER_THREADS at a time: a warp's pairs of one expert by __match_any_sync, earlier warps'
// through per-warp counts in shared memory, earlier rounds through a running count.
extern "C" __global__ void __launch_bounds__(SCATTER_THREADS)
    moe_scatter(const int* __restrict__ idx, i64 pairs, int E, const int* __restrict__ base,
                const int* __restrict__ ends, int cap, int* __restrict__ pos, int* __restrict__ src) {
  extern __shared__ int smem_i[];
  int* running = smem_i;        // [E]
  int* wcnt = smem_i + E;       // [SCATTER_WARPS][E]
  for (int i = threadIdx.x; i < E * (SCATTER_WARPS + 1); i += blockDim.x) smem_i[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned lt = (1u << lane) - 1;
  const i64 c0 = (i64)blockIdx.x * CHUNK;
  for (int r0 = 0; r0 < CHUNK; r0 += SCATTER_THREADS) {
    const i64 p = c0 + r0 + threadIdx.x;
    const int e = p < pairs ? idx[p] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int leader = __ffs(peers) - 1;
    if (e >= 0 && lane == leader) wcnt[warp * E + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int local = running[e] + __popc(peers & lt);
      for (int w2 = 0; w2 < warp; ++w2) local += wcnt[w2 * E + e];
      const int rank = base[blockIdx.x * (i64)E + e] + local;
      const bool kept = cap < 0 || rank < cap;
      const int row = (e > 0 ? ends[e - 1] : 0) + rank;
      pos[p] = kept ? row : -1;
      if (kept) src[row] = (int)p;
    }
    __syncthreads();
    if (e >= 0 && lane == leader) {
      atomicAdd(&running[e], __popc(peers));
      wcnt[warp * E + e] = 0;
    }
    __syncthreads();
  }
}

// Rows into the layout, by token: dst[pos[t,j]] = x[t] for every kept slot j (the forward's x
// into xp, the backward's dout into dyu), then every padding row of the used ones (rsrc[r] < 0)
// zeroed. Each token's row is read once and written k times: T·H read instead of the T·k·H a
// pass by layout row reads (x is larger than L2 at real sizes, so a pass in expert order reads it
// from DRAM k times over). One warp per token, then one per padding row; 16-byte vectors when
// `vec` (H·sizeof(T) a multiple of 16 and both bases aligned). A warp loads SPREAD_UNROLL
// vectors per lane (4 KiB of the row) into registers with every load in flight at once, then
// stores them to each slot's row: a loop that loaded and stored one vector at a time kept one
// DRAM read per warp in flight and ran at about half the copy rate. Every row is written by
// exactly one warp.
constexpr int SPREAD_UNROLL = 8;

template <typename V>
__device__ __forceinline__ void spread_row(const V* __restrict__ s, i64 n, int mine, int k, int lane,
                                           V* __restrict__ dst, i64 row_len) {
  for (i64 b = 0; b < n; b += 32 * SPREAD_UNROLL) {
    V v[SPREAD_UNROLL];
#pragma unroll
    for (int u = 0; u < SPREAD_UNROLL; ++u) {
      const i64 i = b + u * 32 + lane;
      if (i < n) v[u] = s[i];
    }
    for (int j = 0; j < k; ++j) {
      const int r = __shfl_sync(0xffffffffu, mine, j);
      if (r < 0) continue;
      V* d = dst + (i64)r * row_len;
#pragma unroll
      for (int u = 0; u < SPREAD_UNROLL; ++u) {
        const i64 i = b + u * 32 + lane;
        if (i < n) d[i] = v[u];
      }
    }
  }
}

template <typename V>
__device__ __forceinline__ void zero_row(V* __restrict__ d, i64 n, int lane, V zero) {
  for (i64 b = 0; b < n; b += 32 * SPREAD_UNROLL) {
#pragma unroll
    for (int u = 0; u < SPREAD_UNROLL; ++u) {
      const i64 i = b + u * 32 + lane;
      if (i < n) d[i] = zero;
    }
  }
}

// The scalar path moves elements as raw bits of their size (a 16-bit T held in an 8-array went
// to local memory on sm_80).
template <int S> struct RawOf;
template <> struct RawOf<2> { typedef unsigned short t; };
template <> struct RawOf<4> { typedef unsigned t; };
typedef RawOf<sizeof(T)>::t Raw;

extern "C" __global__ void __launch_bounds__(256)
    moe_spread_rows(const T* __restrict__ x, i64 H, const int* __restrict__ pos, int k, int ntok,
                    const int* __restrict__ rsrc, const int* __restrict__ ends, int E, int vec,
                    T* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const i64 warp0 = (i64)blockIdx.x * 8 + threadIdx.x / 32, warps = (i64)gridDim.x * 8;
  const i64 nv = H * (i64)sizeof(T) / 16;
  for (i64 t = warp0; t < ntok; t += warps) {
    const int mine = lane < k ? pos[t * k + lane] : -1;  // k ≤ 32 (MAX_TOP_K)
    if (vec) {
      spread_row(reinterpret_cast<const uint4*>(x + t * H), nv, mine, k, lane,
                 reinterpret_cast<uint4*>(dst), nv);
    } else {
      spread_row(reinterpret_cast<const Raw*>(x + t * H), H, mine, k, lane,
                 reinterpret_cast<Raw*>(dst), H);
    }
  }
  const i64 used = ends[E - 1];
  for (i64 r = warp0; r < used; r += warps) {
    if (rsrc[r] >= 0) continue;
    if (vec) {
      zero_row(reinterpret_cast<uint4*>(dst + r * H), nv, lane, make_uint4(0, 0, 0, 0));
    } else {
      zero_row(reinterpret_cast<Raw*>(dst + r * H), H, lane, (Raw)0);
    }
  }
}

// out[t] = Σ_j c_j·src[pos[t,j]] over the token's slots (dropped ones add nothing), c_j = w[t,j]
// or 1 (w null), fp32 in slot order. One block per token; the slots' rows and weights go to
// shared memory once; with `vec` (H·sizeof(T) a multiple of 16, aligned bases) each thread
// gathers 16-byte vectors from every slot's row (k loads in flight), else scalars.
__device__ __forceinline__ void gather_sum(const T* __restrict__ src, i64 H, const int* __restrict__ pos,
                                           const float* __restrict__ w, int k, int ntok, int vec,
                                           T* __restrict__ out) {
  __shared__ int rows[32];
  __shared__ float cw[32];
  constexpr int N = Vec16<T>::N;
  for (i64 t = blockIdx.x; t < ntok; t += gridDim.x) {
    __syncthreads();  // the previous token's slots are no longer read
    if (threadIdx.x < k) {
      rows[threadIdx.x] = pos[t * k + threadIdx.x];
      cw[threadIdx.x] = w ? w[t * k + threadIdx.x] : 1.f;
    }
    __syncthreads();
    if (vec) {
      const i64 nv = H / N;
      for (i64 c = threadIdx.x; c < nv; c += blockDim.x) {
        float acc[N];
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = 0.f;
        for (int j = 0; j < k; ++j) {
          const int r = rows[j];
          if (r < 0) continue;
          const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(src + (i64)r * H)[c];
#pragma unroll
          for (int e = 0; e < N; ++e) acc[e] = fmaf(cw[j], to_float(v.v[e]), acc[e]);
        }
        Vec16<T> o;
#pragma unroll
        for (int e = 0; e < N; ++e) o.v[e] = from_float<T>(acc[e]);
        reinterpret_cast<Vec16<T>*>(out + t * H)[c] = o;
      }
    } else {
      for (i64 c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j)
          if (rows[j] >= 0) acc = fmaf(cw[j], to_float(src[(i64)rows[j] * H + c]), acc);
        out[t * H + c] = from_float<T>(acc);
      }
    }
  }
}

// The combine: out[t] = Σ_j w[t,j]·y[pos[t,j]].
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const T* __restrict__ y, i64 H, const int* __restrict__ pos,
                const float* __restrict__ w, int k, int ntok, int vec, T* __restrict__ out) {
  gather_sum(y, H, pos, w, k, ntok, vec, out);
}

// The GLU's backward with the gates folded in, one warp per used row r (p = src[r], s = w[p],
// 0 on padding rows): from the pre-activations hpre[r] = (gate | up) and gu[r] = dyu[r]·W_downᵀ
// (the down projection's dX of the unscaled gradient),
//   a = act(gate) ⊙ up           (recomputed, rounded as the forward rounds it)
//   dw[p] = <gu[r], a>           (the gate's gradient: <dout[t], y[r]> = <dout[t]·W_downᵀ, a>)
//   wa[r] = s·a                  (the down projection's dW operand: dW = Σ_r (s·a)ᵀ·dyu)
//   da = s·gu;  dhpre[r] = (da ⊙ up ⊙ act'(gate) | da ⊙ act(gate))
// So neither y nor the GLU output a is kept from the forward. Rows n apart (hpre, dhpre 2n);
// vec: n a multiple of the 16-byte vector and every base aligned. wa may be gu itself (the host
// passes the same buffer): each element is read by the lane that then writes it. A warp per row
// (not a block): rows are short (I = 768 is 96 vectors) and the dot product needs no barrier.
template <int ACT>
// dhpre may be hpre itself (the backward writes the gradient over the pre-activations): every
// element is read and then written by the same thread, so neither pointer is __restrict__.
__device__ __forceinline__ void glu_bwd_rows(const T* gu, const T* hpre, i64 n,
                                             const int* __restrict__ src,
                                             const float* __restrict__ w, i64 used, int vec,
                                             T* dhpre, T* wa, float* __restrict__ dw) {
  constexpr int N = Vec16<T>::N;
  const int lane = threadIdx.x % 32;
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  for (i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < used; r += warps) {
    const int p = src[r];
    T* dg = dhpre + r * 2 * n;
    T* du = dg + n;
    T* wr = wa + r * n;
    if (p < 0) {
      for (i64 c = lane; c < n; c += 32) dg[c] = du[c] = wr[c] = from_float<T>(0.f);
      continue;
    }
    const float s = w[p];
    const T* gr = gu + r * n;
    const T* hg = hpre + r * 2 * n;
    const T* hu = hg + n;
    float dot = 0.f;
    // One element: its three outputs and its term of the dot product.
    struct Out {
      T dg, du, wa;
      float dot;
    };
    auto one = [&](T g, T gate, T up) {
      float a, d;
      act_fg_of<ACT>(to_float(gate), a, d);
      const float u = to_float(up), gv = to_float(g);
      const float h = to_float(from_float<T>(a * u));  // the forward's rounded GLU output
      const float da = s * gv;
      return Out{from_float<T>(da * u * d), from_float<T>(da * a), from_float<T>(s * h), gv * h};
    };
    if (vec) {
      for (i64 c = lane; c < n / N; c += 32) {
        const Vec16<T> gv = reinterpret_cast<const Vec16<T>*>(gr)[c];
        const Vec16<T> gt = reinterpret_cast<const Vec16<T>*>(hg)[c];
        const Vec16<T> up = reinterpret_cast<const Vec16<T>*>(hu)[c];
        Vec16<T> o1, o2, o3;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const Out o = one(gv.v[e], gt.v[e], up.v[e]);
          o1.v[e] = o.dg;
          o2.v[e] = o.du;
          o3.v[e] = o.wa;
          dot += o.dot;
        }
        reinterpret_cast<Vec16<T>*>(dg)[c] = o1;
        reinterpret_cast<Vec16<T>*>(du)[c] = o2;
        reinterpret_cast<Vec16<T>*>(wr)[c] = o3;
      }
    } else {
      for (i64 c = lane; c < n; c += 32) {
        const Out o = one(gr[c], hg[c], hu[c]);
        dg[c] = o.dg;
        du[c] = o.du;
        wr[c] = o.wa;
        dot += o.dot;
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[p] = dot;
  }
}
// One entry per activation (the activation family's codes: _0 none, _1 relu, _2 gelu_tanh,
// _3 gelu_erf, _4 silu; one kernel switching over all five made ptxas spill). Rows up to
// ends[E - 1] (read on the device). Dropped pairs' dw is set to 0 by the caller's fill.
#define MOE_GLU_BWD(ACT)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) moe_glu_bwd_##ACT(                          \
      const T* gu, const T* hpre, i64 n, const int* __restrict__ src,                           \
      const float* __restrict__ w, const int* __restrict__ ends, int E, int vec,                \
      T* dhpre, T* wa, float* __restrict__ dw) {                                                \
    glu_bwd_rows<ACT>(gu, hpre, n, src, w, ends[E - 1], vec, dhpre, wa, dw);                    \
  }
MOE_GLU_BWD(0)
MOE_GLU_BWD(1)
MOE_GLU_BWD(2)
MOE_GLU_BWD(3)
MOE_GLU_BWD(4)

// The permutation's backward: dx[t] = Σ_j dxp[pos[t,j]].
extern "C" __global__ void __launch_bounds__(256)
    moe_unpermute_grad(const T* __restrict__ dxp, i64 H, const int* __restrict__ pos, int k,
                       int ntok, int vec, T* __restrict__ dx) {
  gather_sum(dxp, H, pos, nullptr, k, ntok, vec, dx);
}

// dlogits for one token per warp: the gates' gradient dw through the weights (renormalised:
// w_j = scale·s_j/S, S = Σ_sel s) onto the selected scores, the auxiliary loss
// aux_coef·E·Σ_i f_i·P_i (f_i = counts_i/(T·k) held constant, P_i = mean_t s_{t,i}) onto every
// score, then through the scoring function (softmax: p_i·(ds_i − Σ p·ds); sigmoid: s(1−s)·ds),
// plus the z-loss z_coef·mean_t lse_t² (2·z_coef·lse/T · softmax), both losses' terms scaled by
// their incoming gradients loss_grad[0], loss_grad[1] when given. Shared memory: E floats per
// warp.
extern "C" __global__ void __launch_bounds__(128)
    moe_router_bwd(const float* __restrict__ dw, const int* __restrict__ idx,
                   const float* __restrict__ probs, const float* __restrict__ lse,
                   const T* __restrict__ logits, i64 ld, const int* __restrict__ counts, int ntok,
                   int E, int k, int score, int renorm, float scale, float aux_coef, float z_coef,
                   const float* __restrict__ loss_grad, T* __restrict__ dlogits, i64 ldd) {
  extern __shared__ float smem_f[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* ds = smem_f + warp * E;
  // The incoming gradients of the aux and z-losses (null: 1 each), read on the device so a
  // captured step needs no host value.
  if (loss_grad) {
    aux_coef *= loss_grad[0];
    z_coef *= loss_grad[1];
  }
  const float aux = aux_coef * (float)E / ((float)ntok * (float)ntok * (float)k);
  for (i64 t = (i64)blockIdx.x * 4 + warp; t < ntok; t += (i64)gridDim.x * 4) {
    const float* p = probs + t * E;
    for (int e = lane; e < E; e += 32) ds[e] = aux * (float)counts[e];
    __syncwarp();
    // Selected slots (lane j < k): S and Σ dw·s.
    float s = 0.f, g = 0.f;
    int ej = 0;
    if (lane < k) {
      ej = idx[t * k + lane];
      s = p[ej];
      g = dw[t * k + lane];
    }
    const float S = warp_sum(lane < k ? s : 0.f);
    const float GS = warp_sum(lane < k ? g * s : 0.f);
    // Lanes add in turn (an expert is selected at most once, but keep the order fixed anyway).
    for (int j = 0; j < k; ++j) {
      if (lane == j) ds[ej] += renorm ? scale * (g / S - GS / (S * S)) : scale * g;
      __syncwarp();
    }
    float dot = 0.f;
    if (score == 0) {
      for (int e = lane; e < E; e += 32) dot = fmaf(p[e], ds[e], dot);
      dot = warp_sum(dot);
    }
    const float l = lse[t];
    const float zc = 2.f * z_coef * l / (float)ntok;
    const T* row = logits + t * ld;
    for (int e = lane; e < E; e += 32) {
      const float pe = p[e];
      float d = score == 0 ? pe * (ds[e] - dot) : ds[e] * pe * (1.f - pe);
      if (z_coef != 0.f) d = fmaf(zc, __expf(to_float(row[e]) - l), d);
      dlogits[t * ldd + e] = from_float<T>(d);
    }
    __syncwarp();
  }
}

// Per block of `rows` tokens: part[b][e] = Σ_t probs[t][e] (e < E), part[b][E] = Σ_t lse_t².
// Threads stride over columns, rows in order: deterministic.
extern "C" __global__ void __launch_bounds__(256)
    moe_stats_partial(const float* __restrict__ probs, const float* __restrict__ lse, int ntok,
                      int E, int rows, float* __restrict__ part) {
  const i64 t0 = (i64)blockIdx.x * rows;
  const i64 t1 = min((i64)ntok, t0 + rows);
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    float acc = 0.f;
    if (e < E) {
      for (i64 t = t0; t < t1; ++t) acc += probs[t * E + e];
    } else {
      for (i64 t = t0; t < t1; ++t) acc = fmaf(lse[t], lse[t], acc);
    }
    part[(i64)blockIdx.x * (E + 1) + e] = acc;
  }
}

// One block: out[0] = aux loss, out[1] = z-loss, out[2 + e] = P_e (mean score of expert e).
extern "C" __global__ void __launch_bounds__(256)
    moe_stats_final(const float* __restrict__ part, int blocks, int E, const int* __restrict__ counts,
                    int ntok, int k, float aux_coef, float z_coef, float* __restrict__ out) {
  __shared__ float red[64];  // block_sum2 owns 64 floats
  float aux = 0.f;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    float acc = 0.f;
    for (int b = 0; b < blocks; ++b) acc += part[(i64)b * (E + 1) + e];
    if (e < E) {
      const float P = acc / (float)ntok;
      out[2 + e] = P;
      aux += (float)counts[e] / ((float)ntok * (float)k) * P;
    } else {
      out[1] = z_coef * acc / (float)ntok;
    }
  }
  aux = block_sum(aux, red);
  if (threadIdx.x == 0) out[0] = aux_coef * (float)E * aux;
}

// Expert parallelism's bookkeeping (ep.rs): the sizes of the padded expert segments a rank sends,
// each layout row's gate weight (sent with the row, read by the owner's moe_glu_bwd), and the
// gates' gradients back from rows to (token, slot) pairs.
extern "C" __global__ void moe_ep_seg_sizes(const int* __restrict__ ends, int E,
                                            int* __restrict__ out) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x)
    out[e] = ends[e] - (e > 0 ? ends[e - 1] : 0);
}

// out[i] = vals[idx[i]], 0 where idx[i] < 0: each layout row's gate weight from its pair (idx =
// src), or each pair's gate gradient from its row (idx = pos).
extern "C" __global__ void moe_ep_gather_f32(const float* __restrict__ vals,
                                             const int* __restrict__ idx, i64 n,
                                             float* __restrict__ out) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const int j = idx[i];
    out[i] = j >= 0 ? vals[j] : 0.f;
  }
}

extern "C" __global__ void moe_iota(int* __restrict__ p, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    p[i] = (int)i;
}

// dst[r] = src[map[r]] for rows of row_bytes (r < n), one warp per row: an expert-parallel
// layer's rows between the order they arrive in (by sending rank) and the experts' order.
// 16-byte moves when rows and bases allow (vec), bytes otherwise.
extern "C" __global__ void __launch_bounds__(256)
    moe_ep_gather_rows(const unsigned char* __restrict__ src, i64 row_bytes,
                       const int* __restrict__ map, i64 n, int vec,
                       unsigned char* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  for (i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < n; r += warps) {
    const unsigned char* s = src + (i64)map[r] * row_bytes;
    unsigned char* d = dst + r * row_bytes;
    if (vec) {
      for (i64 c = lane; c < row_bytes / 16; c += 32)
        reinterpret_cast<uint4*>(d)[c] = reinterpret_cast<const uint4*>(s)[c];
    } else {
      for (i64 c = lane; c < row_bytes; c += 32) d[c] = s[c];
    }
  }
}
