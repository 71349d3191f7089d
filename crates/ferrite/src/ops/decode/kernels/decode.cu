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

// Scale, optional soft-capping, then into the log2 domain.
__device__ __forceinline__ float score_log2(float dot, float scale, float softcap) {
  float s = dot * scale;
  if (softcap > 0.f) s = softcap * tanhf(s / softcap);
  return s * LOG2E;
}

// exp2(m − m_new) as a rescale factor; 0 when m is −inf (nothing accumulated yet).
__device__ __forceinline__ float rescale(float m, float m_new) {
  return m == NEG_INF ? 0.f : exp2f(m - m_new);
}

// The visible keys [lo, hi) of sequence b; a length out of range is flagged and treated as 0.
__device__ __forceinline__ void key_range(const int* __restrict__ seq_lens, i64 b, i64 capacity,
                                          i64 window_left, int* err, i64& lo, i64& hi) {
  i64 len = seq_lens[b];
  if (len < 0 || len > capacity) {
    atomicOr(err, ERR_SEQ_LEN);
    len = 0;
  }
  hi = len;
  lo = (window_left >= 0 && len - 1 - window_left > 0) ? len - 1 - window_left : 0;
}

// The cache slot (block·block_size + offset) of key j < capacity of sequence b, or −1 when its
// block-table entry is out of range (flagged).
__device__ __forceinline__ i64 key_slot(const int* __restrict__ bt, i64 b, i64 j, i64 max_blocks,
                                        i64 block_size, i64 num_blocks, int* err) {
  const i64 blk = bt[b * max_blocks + j / block_size];
  if (blk < 0 || blk >= num_blocks) {
    atomicOr(err, ERR_BLOCK);
    return -1;
  }
  return blk * block_size + j % block_size;
}

// Requires blockDim.x == 128 and d <= 256.
extern "C" __global__ void __launch_bounds__(128)
    decode_naive(T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ q,
                 const T* __restrict__ kc, const T* __restrict__ vc, const int* __restrict__ bt,
                 const int* __restrict__ seq_lens, int* err, i64 batch, i64 hq, i64 hkv, i64 d,
                 i64 num_blocks, i64 block_size, i64 max_blocks, float scale, float softcap,
                 i64 window_left) {
  __shared__ float qs[256];
  __shared__ float ps[128];
  __shared__ i64 rows[128];
  __shared__ float red[64];
  const int tid = threadIdx.x;
  const i64 group = hq / hkv;
  for (i64 bh = blockIdx.x; bh < batch * hq; bh += gridDim.x) {
    const i64 b = bh / hq, h = bh % hq, kvh = h / group;
    __syncthreads();  // the previous row's readers of qs are done
    for (i64 e = tid; e < d; e += 128) qs[e] = to_float(q[bh * d + e]);
    __syncthreads();
    i64 lo, hi;
    key_range(seq_lens, b, max_blocks * block_size, window_left, err, lo, hi);
    float m = NEG_INF, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    for (i64 c0 = lo; c0 < hi; c0 += 128) {
      const i64 j = c0 + tid;
      float s = NEG_INF;
      i64 row = -1;
      if (j < hi) {
        const i64 slot = key_slot(bt, b, j, max_blocks, block_size, num_blocks, err);
        if (slot >= 0) {
          row = (slot * hkv + kvh) * d;
          float dot = 0.f;
          for (i64 e = 0; e < d; ++e) dot += qs[e] * to_float(kc[row + e]);
          s = score_log2(dot, scale, softcap);
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
      const int n = (int)min((i64)128, hi - c0);
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
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (tid < d) o[bh * d + tid] = from_float<T>(acc0 * inv);
    if (tid + 128 < d) o[bh * d + tid + 128] = from_float<T>(acc1 * inv);
    if (tid == 0 && lse != nullptr) lse[bh] = l > 0.f ? (m + log2f(l)) * LN2 : NEG_INF;
  }
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

typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;
constexpr int NV = FE_D / VEC;  // 16-byte vectors per row (FE_D % VEC == 0, checked on the host)
constexpr int TPK = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : NV <= 16 ? 16 : 32;
constexpr int KPW = 32 / TPK;  // keys per warp per step
static_assert(FE_D % VEC == 0 && NV <= 32, "head dim must be a multiple of the vector, ≤ 32 vectors");

// Loads this lane's vector of key j's K and V rows (zeros when the lane is past the row, the key
// is past `end`, or its block entry is bad); returns whether the key counts.
__device__ __forceinline__ bool load_kv(const T* __restrict__ kc, const T* __restrict__ vc,
                                        const int* __restrict__ bt, int* err, i64 b, i64 j,
                                        i64 end, i64 kvh, i64 hkv, i64 num_blocks, i64 block_size,
                                        i64 max_blocks, int vi, Vec& k, Vec& v) {
  if (j < end) {
    const i64 slot = key_slot(bt, b, j, max_blocks, block_size, num_blocks, err);
    if (slot >= 0) {
      if (vi < NV) {
        const i64 off = (slot * hkv + kvh) * FE_D + (i64)vi * VEC;
        k = *reinterpret_cast<const Vec*>(kc + off);
        v = *reinterpret_cast<const Vec*>(vc + off);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) k.v[e] = v.v[e] = from_float<T>(0.f);
      }
      return true;
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) k.v[e] = v.v[e] = from_float<T>(0.f);
  return false;
}

// grid.x = batch · hkv · (group / FE_G), grid.y = num_parts; blockDim.x = FE_WARPS · 32.
// num_parts == 1: writes o (and lse). Otherwise writes part[((b·hq + h)·num_parts + y)·(FE_D+2)
// + {0: max (log2 domain), 1: sum, 2..: unnormalised acc}] for decode_reduce.
extern "C" __global__ void __launch_bounds__(FE_WARPS * 32)
    decode_gqa(T* __restrict__ o, float* __restrict__ lse, float* __restrict__ part,
               const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
               const int* __restrict__ bt, const int* __restrict__ seq_lens, int* err, i64 batch,
               i64 hq, i64 hkv, i64 num_blocks, i64 block_size, i64 max_blocks, float scale,
               float softcap, i64 window_left, i64 part_size, i64 num_parts) {
  __shared__ float sm_acc[FE_WARPS][FE_G][FE_D];
  __shared__ float sm_m[FE_WARPS][FE_G];
  __shared__ float sm_l[FE_WARPS][FE_G];
  const i64 group = hq / hkv, nhb = group / FE_G;
  const i64 bx = blockIdx.x;
  const i64 b = bx / (hkv * nhb), r = bx % (hkv * nhb);
  const i64 kvh = r / nhb, h0 = kvh * group + (r % nhb) * FE_G;
  const i64 pi = blockIdx.y;
  if (b >= batch) return;  // block-uniform
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = lane / TPK, vi = lane % TPK;

  i64 lo, hi;
  key_range(seq_lens, b, max_blocks * block_size, window_left, err, lo, hi);
  i64 start = lo, end = hi;
  if (num_parts > 1) {
    start = lo + pi * part_size;
    end = min(start + part_size, hi);
  }

  float qf[FE_G][VEC];
#pragma unroll
  for (int g = 0; g < FE_G; ++g) {
    if (vi < NV) {
      const Vec a = *reinterpret_cast<const Vec*>(q + (b * hq + h0 + g) * FE_D + (i64)vi * VEC);
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][e] = to_float(a.v[e]);
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

  const i64 stride = (i64)FE_WARPS * KPW;
  i64 j0 = start + (i64)warp * KPW;  // this warp's first key of the step; warp-uniform
  Vec kv, vv;
  bool valid = load_kv(kc, vc, bt, err, b, j0 + kg, end, kvh, hkv, num_blocks, block_size,
                       max_blocks, vi, kv, vv);
  for (; j0 < end; j0 += stride) {
    Vec kn, vn;
    const bool valid_n = load_kv(kc, vc, bt, err, b, j0 + stride + kg, end, kvh, hkv, num_blocks,
                                 block_size, max_blocks, vi, kn, vn);
    float kf[VEC], vf[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      kf[e] = to_float(kv.v[e]);
      vf[e] = to_float(vv.v[e]);
    }
#pragma unroll
    for (int g = 0; g < FE_G; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot = fmaf(qf[g][e], kf[e], dot);
#pragma unroll
      for (int off = TPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (valid) {
        const float s = score_log2(dot, scale, softcap);
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
      o[row * FE_D + dd] = from_float<T>(ls > 0.f ? a / ls : 0.f);
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
      o[row * FE_D + dd] = from_float<T>(ls > 0.f ? a / ls : 0.f);
    }
    if (threadIdx.x == 0 && lse != nullptr) lse[row] = ls > 0.f ? (mx + log2f(ls)) * LN2 : NEG_INF;
  }
}

#endif  // FE_GQA
