// decode — attention of one query token per sequence over a paged KV cache (vLLM layout:
// cache [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int, seq_lens [B] int).
//
// Specialisation: -DFE_ELEM=<storage type>; gqa/reduce also -DFE_GQA, -DFE_D=<head dim>,
// -DFE_G=<query heads per block>, -DFE_WARPS=<warps per block>.
// Scores in the log2 domain (log2(e) folded after scale/softcap) so the softmax uses exp2f.
//
// step 1 — decode_naive: a block of 128 threads per (sequence, query head). Keys go in chunks of
//   128, a thread per key: its dot product with scalar loads along the row (uncoalesced), chunk
//   max/sum by block reductions, then every thread adds Σ p·v for its 2 output dims. Each query
//   head of a GQA group re-reads the same K/V: Hq/Hkv times the necessary traffic.
// step 2 — decode_gqa: a block of FE_WARPS warps per (sequence, kv head, FE_G query heads). A key's
//   row is split over TPK lanes, one 16-byte vector each (TPK = D/8 rounded up to a power of two),
//   so a warp reads 32/TPK keys per step with fully used 16-byte loads, and every K/V element is
//   read from HBM once for all FE_G heads. Dot products finish with log2(TPK) shuffles; each lane
//   keeps (max, sum, acc[8]) per head in registers (online softmax, rescaling only when the max
//   grows) and loads the next step's K/V before computing this one. Key groups, then warps, are
//   merged at the end (shuffles, then shared memory).
// step 3 — split_kv (flash-decoding): the same decode_gqa over grid.y = context partitions of
//   part_size keys, each writing a partial (max, sum, acc[D]) in f32 to a workspace;
//   decode_reduce merges the partials. With few sequences (B·Hkv blocks < the SMs) this is what
//   puts the whole GPU on the context.
//
// Bad indices never cause an out-of-bounds read: a seq_len outside 0..=max_blocks·block_size is
// treated as 0, a block-table entry outside 0..num_blocks skips its keys; both set bits of *err,
// which the host reads after the launch.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif

typedef FE_ELEM T;
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (-__int_as_float(0x7f800000))

// Error bits (mirrored in mod.rs).
#define ERR_SEQ_LEN 1
#define ERR_BLOCK 2

// Scale, optional soft-capping (inv_cap = 1/softcap from the host: an IEEE division or
// reciprocal on the device brings a slow-path subroutine call, and spills with it), then into the
// log2 domain.
__device__ __forceinline__ float score_log2(float dot, float scale, float softcap, float inv_cap) {
  float s = dot * scale;
  if (softcap > 0.f) s = softcap * tanhf(s * inv_cap);
  return s * LOG2E;
}

// 1/x for a softmax sum (≥ 1 whenever a key counted: the max term contributes exp2(0)), else 0.
__device__ __forceinline__ float inverse_or_zero(float x) { return x > 0.f ? __fdividef(1.f, x) : 0.f; }

// exp2(m − m_new) as a rescale factor; 0 when m is −inf (nothing accumulated yet).
__device__ __forceinline__ float rescale(float m, float m_new) {
  return m == NEG_INF ? 0.f : exp2f(m - m_new);
}

// The visible keys [lo, hi) of sequence b; a length out of range is flagged and treated as 0.
// Key indices are 32-bit: the host checks max_blocks·block_size < 2³¹ (lengths are int anyway),
// which keeps the per-key block/offset split a 32-bit division.
__device__ __forceinline__ void key_range(const int* __restrict__ seq_lens, i64 b, int capacity,
                                          i64 window_left, int* err, int& lo, int& hi) {
  int len = seq_lens[b];
  if (len < 0 || len > capacity) {
    atomicOr(err, ERR_SEQ_LEN);
    len = 0;
  }
  hi = len;
  lo = (window_left >= 0 && (i64)len - 1 - window_left > 0) ? (int)(len - 1 - window_left) : 0;
}

// The cache slot (block·block_size + offset) of key j < capacity of sequence b, or −1 when its
// block-table entry is out of range (flagged).
__device__ __forceinline__ i64 key_slot(const int* __restrict__ bt_row, int j, int block_size,
                                        i64 num_blocks, int* err) {
  const int blk = bt_row[j / block_size];
  if (blk < 0 || blk >= num_blocks) {
    atomicOr(err, ERR_BLOCK);
    return -1;
  }
  return (i64)blk * block_size + j % block_size;
}

// Requires blockDim.x == 128, gridDim.x == batch·hq and d <= 256.
extern "C" __global__ void __launch_bounds__(128)
    decode_naive(T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ q,
                 const T* __restrict__ kc, const T* __restrict__ vc, const int* __restrict__ bt,
                 const int* __restrict__ seq_lens, int* err, i64 batch, i64 hq, i64 hkv, i64 d,
                 i64 num_blocks, i64 block_size, i64 max_blocks, float scale, float softcap,
                 float inv_cap, i64 window_left) {
  __shared__ float qs[256];
  __shared__ float ps[128];
  __shared__ i64 rows[128];
  __shared__ float red[64];
  const int tid = threadIdx.x;
  const int bsz = (int)block_size, group = (int)hq / (int)hkv;  // 32-bit: no division call
  // grid.x == batch · hq (≤ 2³¹−1, checked on the host): one row per block.
  const i64 bh = blockIdx.x;
  const int h = (int)(blockIdx.x % (unsigned)hq);
  const i64 b = blockIdx.x / (unsigned)hq;
  const int kvh = h / group;
  const int* bt_row = bt + b * max_blocks;
  for (int e = tid; e < d; e += 128) qs[e] = to_float(q[bh * d + e]);
  __syncthreads();
  int lo, hi;
  key_range(seq_lens, b, (int)(max_blocks * block_size), window_left, err, lo, hi);
  float m = NEG_INF, l = 0.f, acc0 = 0.f, acc1 = 0.f;
  for (int c0 = lo; c0 < hi; c0 += 128) {
    const int j = c0 + tid;
    float s = NEG_INF;
    i64 row = -1;
    if (j < hi) {
      const i64 slot = key_slot(bt_row, j, bsz, num_blocks, err);
      if (slot >= 0) {
        row = (slot * hkv + kvh) * d;
        float dot = 0.f;
        for (int e = 0; e < d; ++e) dot += qs[e] * to_float(kc[row + e]);
        s = score_log2(dot, scale, softcap, inv_cap);
      }
    }
    rows[tid] = row;
    const float m_new = fmaxf(m, block_max(s, red));  // its barriers publish rows[]
    if (m_new == NEG_INF) {
      __syncthreads();
      continue;  // no visible key yet (block-uniform)
    }
    const float p = s == NEG_INF ? 0.f : exp2f(s - m_new);
    ps[tid] = p;
    const float alpha = rescale(m, m_new);
    l = l * alpha + block_sum(p, red);  // its barriers publish ps[]
    acc0 *= alpha;
    acc1 *= alpha;
    const int n = min(128, hi - c0);
    for (int i = 0; i < n; ++i) {
      const i64 r = rows[i];
      if (r < 0) continue;
      const float pi = ps[i];
      if (tid < d) acc0 += pi * to_float(vc[r + tid]);
      if (tid + 128 < d) acc1 += pi * to_float(vc[r + tid + 128]);
    }
    m = m_new;
    __syncthreads();  // done with rows[]/ps[] before the next chunk writes them
  }
  const float inv = inverse_or_zero(l);
  if (tid < d) o[bh * d + tid] = from_float<T>(acc0 * inv);
  if (tid + 128 < d) o[bh * d + tid + 128] = from_float<T>(acc1 * inv);
  if (tid == 0 && lse != nullptr) lse[bh] = l > 0.f ? (m + log2f(l)) * LN2 : NEG_INF;
}

#ifdef FE_GQA

#ifndef FE_D
#define FE_D 128
#endif
#ifndef FE_G
#define FE_G 1
#endif
#ifndef FE_WARPS
#define FE_WARPS 4
#endif

// K/V/q travel as raw 16-byte words (uint4) and are unpacked in registers: element-wise access
// to a struct of 16-bit values makes the compiler keep it in local memory.
constexpr int VEC = 8;          // 16-bit elements per 16-byte vector (gqa runs f16/bf16 only)
constexpr int NV = FE_D / VEC;  // vectors per row (FE_D % 8 == 0, checked on the host)
constexpr int TPK = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : NV <= 16 ? 16 : 32;
constexpr int KPW = 32 / TPK;  // keys per warp per step
static_assert(sizeof(T) == 2, "the gqa kernel takes f16/bf16");
static_assert(FE_D % VEC == 0 && NV <= 32, "head dim must be a multiple of 8, at most 256");

__device__ __forceinline__ float2 unpack2(unsigned w, const __nv_bfloat16*) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 unpack2(unsigned w, const __half*) {
  return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                     __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}
__device__ __forceinline__ void unpack8(const uint4& r, float* f) {
  const float2 a = unpack2(r.x, (const T*)nullptr), b = unpack2(r.y, (const T*)nullptr);
  const float2 c = unpack2(r.z, (const T*)nullptr), d = unpack2(r.w, (const T*)nullptr);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
}

// Loads this lane's vector of key j's K and V rows (zeros when the lane is past the row, the key
// is past `end`, or its block entry is bad); returns whether the key counts.
__device__ __forceinline__ bool load_kv(const T* __restrict__ kc, const T* __restrict__ vc,
                                        const int* __restrict__ bt_row, int* err, int j, int end,
                                        i64 kvh, i64 hkv, i64 num_blocks, int block_size, int vi,
                                        uint4& k, uint4& v) {
  k = v = make_uint4(0u, 0u, 0u, 0u);
  if (j < end) {
    const i64 slot = key_slot(bt_row, j, block_size, num_blocks, err);
    if (slot >= 0) {
      if (vi < NV) {
        const i64 off = (slot * hkv + kvh) * FE_D + (i64)vi * VEC;
        k = __ldg(reinterpret_cast<const uint4*>(kc + off));
        v = __ldg(reinterpret_cast<const uint4*>(vc + off));
      }
      return true;
    }
  }
  return false;
}

// grid.x = batch · hkv · (group / FE_G), grid.y = num_parts; blockDim.x = FE_WARPS · 32.
// __launch_bounds__(…, 2): without a minimum-blocks hint ptxas capped some specialisations at 96
// registers and spilled; with it they keep their ~110–230 (no spills at sm_80/sm_90a).
// num_parts == 1: writes o (and lse). Otherwise writes part[((b·hq + h)·num_parts + y)·(FE_D+2)
// + {0: max (log2 domain), 1: sum, 2..: unnormalised acc}] for decode_reduce.
extern "C" __global__ void __launch_bounds__(FE_WARPS * 32, 2)
    decode_gqa(T* __restrict__ o, float* __restrict__ lse, float* __restrict__ part,
               const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
               const int* __restrict__ bt, const int* __restrict__ seq_lens, int* err, i64 batch,
               i64 hq, i64 hkv, i64 num_blocks, i64 block_size, i64 max_blocks, float scale,
               float softcap, float inv_cap, i64 window_left, i64 part_size, i64 num_parts) {
  __shared__ float sm_acc[FE_WARPS][FE_G][FE_D];
  __shared__ float sm_m[FE_WARPS][FE_G];
  __shared__ float sm_l[FE_WARPS][FE_G];
  // grid.x = batch · hkv · nhb ≤ 2³¹−1 (host-checked): 32-bit splits of the block index.
  const int group = (int)hq / (int)hkv, nhb = group / FE_G, per_b = (int)hkv * nhb;
  const int bx = blockIdx.x;
  const i64 b = bx / per_b;
  const int r = bx % per_b;
  const int kvh = r / nhb;
  const i64 h0 = (i64)kvh * group + (r % nhb) * FE_G;
  const int pi = blockIdx.y;
  if (b >= batch) return;  // block-uniform
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = lane / TPK, vi = lane % TPK;
  const int bsz = (int)block_size;
  const int* bt_row = bt + b * max_blocks;

  int lo, hi;
  key_range(seq_lens, b, (int)(max_blocks * block_size), window_left, err, lo, hi);
  int start = lo, end = hi;
  if (num_parts > 1) {
    // part_size · num_parts ≤ capacity + part_size < 2³²: compute in 64 bits, clamp.
    const i64 s64 = (i64)lo + (i64)pi * part_size;
    start = (int)min(s64, (i64)hi);
    end = (int)min(s64 + part_size, (i64)hi);
  }

  float qf[FE_G][VEC];
#pragma unroll
  for (int g = 0; g < FE_G; ++g) {
    if (vi < NV) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(q + (b * hq + h0 + g) * FE_D + (i64)vi * VEC)),
              qf[g]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][e] = 0.f;
    }
  }
  float m[FE_G], l[FE_G], acc[FE_G][VEC];
#pragma unroll
  for (int g = 0; g < FE_G; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
  }

  constexpr int stride = FE_WARPS * KPW;
  int j0 = start + warp * KPW;  // this warp's first key of the step; warp-uniform
  uint4 kv, vv;
  bool valid = load_kv(kc, vc, bt_row, err, j0 + kg, end, kvh, hkv, num_blocks, bsz, vi, kv, vv);
  for (; j0 < end; j0 += stride) {
    uint4 kn, vn;
    const bool valid_n =
        load_kv(kc, vc, bt_row, err, j0 + stride + kg, end, kvh, hkv, num_blocks, bsz, vi, kn, vn);
    float kf[VEC], vf[VEC];
    unpack8(kv, kf);
    unpack8(vv, vf);
#pragma unroll
    for (int g = 0; g < FE_G; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot = fmaf(qf[g][e], kf[e], dot);
#pragma unroll
      for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (valid) {
        const float s = score_log2(dot, scale, softcap, inv_cap);
        if (s > m[g]) {
          const float alpha = rescale(m[g], s);
          l[g] *= alpha;
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][e] *= alpha;
          m[g] = s;
        }
        const float p = exp2f(s - m[g]);
        l[g] += p;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
      }
    }
    kv = kn;
    vv = vn;
    valid = valid_n;
  }

  // Merge the warp's key groups (lanes with the same vi, different kg).
#pragma unroll
  for (int off = TPK; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < FE_G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo_ = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float a = rescale(m[g], mn), c = rescale(mo, mn);
      l[g] = l[g] * a + lo_ * c;
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], off) * c;
      m[g] = mn;
    }
  }
  if (kg == 0) {
#pragma unroll
    for (int g = 0; g < FE_G; ++g) {
      if (vi < NV) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) sm_acc[warp][g][vi * VEC + e] = acc[g][e];
      }
      if (vi == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps; one thread per (head, dim).
  for (int idx = threadIdx.x; idx < FE_G * FE_D; idx += FE_WARPS * 32) {
    const int g = idx / FE_D, dd = idx % FE_D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float ls = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) {
      const float c = rescale(sm_m[w][g], mx);
      ls += sm_l[w][g] * c;
      a += sm_acc[w][g][dd] * c;
    }
    const i64 row = b * hq + h0 + g;
    if (num_parts == 1) {
      o[row * FE_D + dd] = from_float<T>(a * inverse_or_zero(ls));
      if (dd == 0 && lse != nullptr) lse[row] = ls > 0.f ? (mx + log2f(ls)) * LN2 : NEG_INF;
    } else {
      float* pp = part + (row * num_parts + pi) * (FE_D + 2);
      pp[2 + dd] = a;
      if (dd == 0) {
        pp[0] = mx;
        pp[1] = ls;
      }
    }
  }
}

// Merges the num_parts partials of each (sequence, query head) row; grid-stride over rows.
extern "C" __global__ void __launch_bounds__(128)
    decode_reduce(T* __restrict__ o, float* __restrict__ lse, const float* __restrict__ part,
                  i64 rows, i64 num_parts) {
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* pr = part + row * num_parts * (FE_D + 2);
    float mx = NEG_INF;
    for (i64 p = 0; p < num_parts; ++p) mx = fmaxf(mx, pr[p * (FE_D + 2)]);
    float ls = 0.f;
    for (i64 p = 0; p < num_parts; ++p)
      ls += pr[p * (FE_D + 2) + 1] * rescale(pr[p * (FE_D + 2)], mx);
    for (int dd = threadIdx.x; dd < FE_D; dd += blockDim.x) {
      float a = 0.f;
      for (i64 p = 0; p < num_parts; ++p)
        a += pr[p * (FE_D + 2) + 2 + dd] * rescale(pr[p * (FE_D + 2)], mx);
      o[row * FE_D + dd] = from_float<T>(a * inverse_or_zero(ls));
    }
    if (threadIdx.x == 0 && lse != nullptr) lse[row] = ls > 0.f ? (mx + log2f(ls)) * LN2 : NEG_INF;
  }
}

#endif  // FE_GQA
