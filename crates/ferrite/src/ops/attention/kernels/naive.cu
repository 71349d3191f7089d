// attention, CUDA step 1 — naive: the score matrix in global memory.
//
// Specialisation: -DFE_ELEM=<storage type of q, k, v, o and the gradients>.
//
// Forward: attn_naive_scores writes S = softcap(scale·q·kᵀ) (−inf where masked) into an f32
// workspace of B·Hq·Sq·Sk floats, one thread per element; attn_naive_softmax turns each row into
// P in place (a block per row, ferrite.cuh block reductions) and writes lse; attn_naive_pv writes
// o = P·v, one thread per output element. Memory grows as Sq·Sk — the O(n²) the flash variants
// remove — and every score makes three trips through global memory.
//
// Backward: S again (attn_naive_scores); attn_naive_bwd_dot: D = rowsum(dO ⊙ o); attn_naive_bwd_dp:
// dP = dO·vᵀ into a second workspace; attn_naive_bwd_ds: P = exp(S − lse) over S and
// dS = P ⊙ (dP − D) ⊙ (1 − tanh²) over dP, in place; attn_naive_bwd_dq: dq = scale·dS·k;
// attn_naive_bwd_dkv: dk = scale·dSᵀ·q, dv = Pᵀ·dO summed over the kv group. Every output element
// is owned by one thread that sums in a fixed order: no atomics, the same bits every run.
//
// Workspace rows are padded to the maximum lengths; for a variable-length batch, sequence b's
// rows start at cu_q[b] / cu_k[b] in the packed seq dimension and its lengths come from them.
// Elements past a sequence's end are −inf in S, 0 in P and dS, and never read from q, k, v.
// Math in fp32, indices in 64 bits.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif

typedef FE_ELEM T;

// Must match `Params` in cuda.rs field for field.
struct Params {
  i64 batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  i64 total_q;  // varlen: packed q rows (the row length of lse); padded: B·Sq
  i64 window_left, window_right;
  i64 q_stride[3], k_stride[3], v_stride[3], o_stride[3];  // (batch, seq, head)
  const int* cu_q;  // null when padded
  const int* cu_k;
  float scale, softcap;
};
static_assert(sizeof(Params) == 192, "Params layout differs from cuda.rs");

#define NEG_INF (-__int_as_float(0x7f800000))

struct Seq {
  i64 q_start, sq, k_start, sk;
};

__device__ __forceinline__ Seq seq_of(const Params& p, i64 b) {
  Seq s;
  if (p.cu_q) {
    s.q_start = p.cu_q[b];
    s.sq = p.cu_q[b + 1] - s.q_start;
    s.k_start = p.cu_k[b];
    s.sk = p.cu_k[b + 1] - s.k_start;
  } else {
    s.q_start = 0;
    s.sq = p.seqlen_q;
    s.k_start = 0;
    s.sk = p.seqlen_k;
  }
  return s;
}

// Element offset of (sequence b, row i, head h) for a tensor with strides st.
__device__ __forceinline__ i64 at(const Params& p, const i64* st, i64 b, i64 start, i64 i, i64 h) {
  return p.cu_q ? (start + i) * st[1] + h * st[2] : b * st[0] + i * st[1] + h * st[2];
}

__device__ __forceinline__ bool visible(const Params& p, const Seq& s, i64 i, i64 j) {
  const i64 pos = i + s.sk - s.sq;
  if (p.window_left >= 0 && j < pos - p.window_left) return false;
  if (p.window_right >= 0 && j > pos + p.window_right) return false;
  return true;
}

__device__ __forceinline__ i64 lse_index(const Params& p, const Seq& s, i64 b, i64 h, i64 i) {
  return p.cu_q ? h * p.total_q + s.q_start + i : (b * p.heads_q + h) * p.seqlen_q + i;
}

// Grid-stride over n elements.
#define FOR_EACH(idx, n) \
  for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < (n); idx += (i64)gridDim.x * blockDim.x)

// ws[((b·Hq + h)·Sq + i)·Sk + j] = capped, scaled score, or −inf (masked or past the sequence).
extern "C" __global__ void attn_naive_scores(float* __restrict__ ws, const T* __restrict__ q,
                                             const T* __restrict__ k, const Params p) {
  const i64 n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  const i64 group = p.heads_q / p.heads_kv;
  FOR_EACH(idx, n) {
    const i64 j = idx % p.seqlen_k;
    const i64 i = (idx / p.seqlen_k) % p.seqlen_q;
    const i64 h = (idx / (p.seqlen_k * p.seqlen_q)) % p.heads_q;
    const i64 b = idx / (p.seqlen_k * p.seqlen_q * p.heads_q);
    const Seq s = seq_of(p, b);
    float out = NEG_INF;
    if (i < s.sq && j < s.sk && visible(p, s, i, j)) {
      const T* qr = q + at(p, p.q_stride, b, s.q_start, i, h);
      const T* kr = k + at(p, p.k_stride, b, s.k_start, j, h / group);
      float acc = 0.f;
      for (i64 d = 0; d < p.head_dim; ++d) acc += to_float(qr[d]) * to_float(kr[d]);
      out = p.scale * acc;
      if (p.softcap > 0.f) out = p.softcap * tanhf(out / p.softcap);
    }
    ws[idx] = out;
  }
}

// A block per row (b, h, i): P = softmax(S row) in place, lse = max + log Σ exp. A row with no
// visible key gets P = 0 and lse = −inf. Rows past a sequence's end are left alone (never read).
extern "C" __global__ void attn_naive_softmax(float* __restrict__ ws, float* __restrict__ lse,
                                              const Params p) {
  __shared__ float red[64];
  const i64 rows = p.batch * p.heads_q * p.seqlen_q;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 i = row % p.seqlen_q;
    const i64 h = (row / p.seqlen_q) % p.heads_q;
    const i64 b = row / (p.seqlen_q * p.heads_q);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) continue;  // uniform across the block
    float* r = ws + row * p.seqlen_k;
    float m = NEG_INF;
    for (i64 j = threadIdx.x; j < s.sk; j += blockDim.x) m = fmaxf(m, r[j]);
    m = block_max(m, red);
    if (m == NEG_INF) {
      for (i64 j = threadIdx.x; j < p.seqlen_k; j += blockDim.x) r[j] = 0.f;
      if (threadIdx.x == 0) lse[lse_index(p, s, b, h, i)] = NEG_INF;
      continue;
    }
    float sum = 0.f;
    for (i64 j = threadIdx.x; j < s.sk; j += blockDim.x) sum += expf(r[j] - m);
    sum = block_sum(sum, red);
    const float inv = 1.f / sum;
    for (i64 j = threadIdx.x; j < p.seqlen_k; j += blockDim.x)
      r[j] = j < s.sk ? expf(r[j] - m) * inv : 0.f;
    if (threadIdx.x == 0) lse[lse_index(p, s, b, h, i)] = m + logf(sum);
  }
}

// o[b, i, h, d] = Σ_j P[b, h, i, j] · v[b, j, h / group, d]; a thread per element of o.
extern "C" __global__ void attn_naive_pv(T* __restrict__ o, const float* __restrict__ ws,
                                         const T* __restrict__ v, const Params p) {
  const i64 n = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const i64 group = p.heads_q / p.heads_kv;
  FOR_EACH(idx, n) {
    const i64 d = idx % p.head_dim;
    const i64 h = (idx / p.head_dim) % p.heads_q;
    const i64 i = (idx / (p.head_dim * p.heads_q)) % p.seqlen_q;
    const i64 b = idx / (p.head_dim * p.heads_q * p.seqlen_q);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) continue;
    const float* pr = ws + ((b * p.heads_q + h) * p.seqlen_q + i) * p.seqlen_k;
    float acc = 0.f;
    for (i64 j = 0; j < s.sk; ++j) acc += pr[j] * to_float(v[at(p, p.v_stride, b, s.k_start, j, h / group) + d]);
    o[at(p, p.o_stride, b, s.q_start, i, h) + d] = from_float<T>(acc);
  }
}

// dsum[lse_index(b, h, i)] = Σ_d dO·o (dO shares o's strides); a thread per (b, h, i).
extern "C" __global__ void attn_naive_bwd_dot(float* __restrict__ dsum, const T* __restrict__ dout,
                                              const T* __restrict__ o, const Params p) {
  const i64 n = p.batch * p.heads_q * p.seqlen_q;
  FOR_EACH(idx, n) {
    const i64 i = idx % p.seqlen_q;
    const i64 h = (idx / p.seqlen_q) % p.heads_q;
    const i64 b = idx / (p.seqlen_q * p.heads_q);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) continue;
    const i64 off = at(p, p.o_stride, b, s.q_start, i, h);
    float acc = 0.f;
    for (i64 d = 0; d < p.head_dim; ++d) acc += to_float(dout[off + d]) * to_float(o[off + d]);
    dsum[lse_index(p, s, b, h, i)] = acc;
  }
}

// dP[b, h, i, j] = dO_i · v_j (0 past a sequence's end); a thread per element.
extern "C" __global__ void attn_naive_bwd_dp(float* __restrict__ dp, const T* __restrict__ dout,
                                             const T* __restrict__ v, const Params p) {
  const i64 n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  const i64 group = p.heads_q / p.heads_kv;
  FOR_EACH(idx, n) {
    const i64 j = idx % p.seqlen_k;
    const i64 i = (idx / p.seqlen_k) % p.seqlen_q;
    const i64 h = (idx / (p.seqlen_k * p.seqlen_q)) % p.heads_q;
    const i64 b = idx / (p.seqlen_k * p.seqlen_q * p.heads_q);
    const Seq s = seq_of(p, b);
    float acc = 0.f;
    if (i < s.sq && j < s.sk) {
      const T* dr = dout + at(p, p.o_stride, b, s.q_start, i, h);
      const T* vr = v + at(p, p.v_stride, b, s.k_start, j, h / group);
      for (i64 d = 0; d < p.head_dim; ++d) acc += to_float(dr[d]) * to_float(vr[d]);
    }
    dp[idx] = acc;
  }
}

// In place: S → P = exp(S − lse), dP → dS = P ⊙ (dP − D) ⊙ (1 − (S/softcap)²) (the capped score
// is softcap·tanh, so tanh = S/softcap). Masked entries and rows with lse = −inf give 0.
extern "C" __global__ void attn_naive_bwd_ds(float* __restrict__ ws_p, float* __restrict__ ws_ds,
                                             const float* __restrict__ lse,
                                             const float* __restrict__ dsum, const Params p) {
  const i64 n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  FOR_EACH(idx, n) {
    const i64 i = (idx / p.seqlen_k) % p.seqlen_q;
    const i64 h = (idx / (p.seqlen_k * p.seqlen_q)) % p.heads_q;
    const i64 b = idx / (p.seqlen_k * p.seqlen_q * p.heads_q);
    const Seq s = seq_of(p, b);
    const float sc = ws_p[idx];
    float pv = 0.f, ds = 0.f;
    if (i < s.sq && sc != NEG_INF) {
      const i64 li = lse_index(p, s, b, h, i);
      const float l = lse[li];
      if (l != NEG_INF) {
        pv = expf(sc - l);
        ds = pv * (ws_ds[idx] - dsum[li]);
        if (p.softcap > 0.f) {
          const float t = sc / p.softcap;
          ds *= 1.f - t * t;
        }
      }
    }
    ws_p[idx] = pv;
    ws_ds[idx] = ds;
  }
}

// dq[b, i, h, d] = scale · Σ_j dS[b, h, i, j] · k[b, j, h / group, d]; a thread per element.
extern "C" __global__ void attn_naive_bwd_dq(T* __restrict__ dq, const float* __restrict__ ws_ds,
                                             const T* __restrict__ k, const Params p) {
  const i64 n = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const i64 group = p.heads_q / p.heads_kv;
  FOR_EACH(idx, n) {
    const i64 d = idx % p.head_dim;
    const i64 h = (idx / p.head_dim) % p.heads_q;
    const i64 i = (idx / (p.head_dim * p.heads_q)) % p.seqlen_q;
    const i64 b = idx / (p.head_dim * p.heads_q * p.seqlen_q);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) continue;
    const float* dr = ws_ds + ((b * p.heads_q + h) * p.seqlen_q + i) * p.seqlen_k;
    float acc = 0.f;
    for (i64 j = 0; j < s.sk; ++j) acc += dr[j] * to_float(k[at(p, p.k_stride, b, s.k_start, j, h / group) + d]);
    dq[at(p, p.q_stride, b, s.q_start, i, h) + d] = from_float<T>(p.scale * acc);
  }
}

// dk[b, j, hk, d] = scale · Σ_{h in group} Σ_i dS[b, h, i, j] · q[b, i, h, d] and
// dv[b, j, hk, d] = Σ_{h in group} Σ_i P[b, h, i, j] · dO[b, i, h, d]; a thread per element.
extern "C" __global__ void attn_naive_bwd_dkv(T* __restrict__ dk, T* __restrict__ dv,
                                              const float* __restrict__ ws_p,
                                              const float* __restrict__ ws_ds,
                                              const T* __restrict__ q, const T* __restrict__ dout,
                                              const Params p) {
  const i64 n = p.batch * p.seqlen_k * p.heads_kv * p.head_dim;
  const i64 group = p.heads_q / p.heads_kv;
  FOR_EACH(idx, n) {
    const i64 d = idx % p.head_dim;
    const i64 hk = (idx / p.head_dim) % p.heads_kv;
    const i64 j = (idx / (p.head_dim * p.heads_kv)) % p.seqlen_k;
    const i64 b = idx / (p.head_dim * p.heads_kv * p.seqlen_k);
    const Seq s = seq_of(p, b);
    if (j >= s.sk) continue;
    float ak = 0.f, av = 0.f;
    for (i64 h = hk * group; h < (hk + 1) * group; ++h) {
      const i64 base = (b * p.heads_q + h) * p.seqlen_q * p.seqlen_k + j;
      for (i64 i = 0; i < s.sq; ++i) {
        const i64 w = base + i * p.seqlen_k;
        ak += ws_ds[w] * to_float(q[at(p, p.q_stride, b, s.q_start, i, h) + d]);
        av += ws_p[w] * to_float(dout[at(p, p.o_stride, b, s.q_start, i, h) + d]);
      }
    }
    dk[at(p, p.k_stride, b, s.k_start, j, hk) + d] = from_float<T>(p.scale * ak);
    dv[at(p, p.v_stride, b, s.k_start, j, hk) + d] = from_float<T>(av);
  }
}
