// decode — attention of one query token per sequence over a paged KV cache (vLLM layout:
// cache [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int, seq_lens [B] int).
//
// Specialisation: -DFE_ELEM=<storage type>; gqa/reduce also -DFE_GQA, -DFE_D=<head dim>,
// -DFE_G=<query heads per block>, -DFE_WARPS=<warps per block>; pipelined/merge -DFE_PIPE with
// FE_D, FE_G, FE_WARPS, -DFE_STAGES=<ring depth>, -DFE_MINB=<launch-bounds blocks per SM>;
// mma/merge -DFE_MMA with FE_D, FE_G, FE_WARPS, FE_STAGES.
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
// step 4 — decode_pipelined: gqa's block and lane layout, but each warp streams its own tiles of
//   keys through a FE_STAGES-deep cp.async ring in shared memory: FE_STAGES − 1 tiles (2 × ~4 KiB
//   per warp) are in flight while one is computed, independent of how many registers the math
//   holds (gqa had one key step per lane in flight, 32 bytes, and stalled on every load). Per tile
//   the scores of all its keys come first (partial dot products reduced by recursive halving,
//   ~1 shuffle per score instead of log2(TPK) per key and head), then one online-softmax rescale
//   per tile instead of a dependent max/rescale per key, then p·V. The host plans partitions
//   from the resident blocks per SM so the grid fills whole waves; decode_merge reduces them with
//   parts spread over threads. See the kernel's comment.
// step 5 — decode_mma: step 4's pipeline with q·k and p·v on tensor cores (mma.sync m16n8k16,
//   the block's query heads as rows 0..FE_G−1 of an m16 tile, 16-key tiles): ~37 instructions per
//   key instead of ~78, most of them now the copies themselves. See the kernel's comment.
//
// Bad indices never cause an out-of-bounds read: a seq_len outside 0..=max_blocks·block_size is
// treated as 0, a block-table entry outside 0..num_blocks skips its keys; both set bits of *err,
// which the host reads after the launch.

#include "ferrite.cuh"
#include "async.cuh"
#include "mma.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif

typedef FE_ELEM T;
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF __int_as_float(0x7f800000)

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

#if defined(FE_GQA) || defined(FE_PIPE) || defined(FE_MMA)

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

__device__ __forceinline__ void unpack8(const uint4& r, float* f) {
  const float2 a = unpack2<T>(r.x), b = unpack2<T>(r.y);
  const float2 c = unpack2<T>(r.z), d = unpack2<T>(r.w);
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

#endif  // FE_GQA || FE_PIPE || FE_MMA

#ifdef FE_GQA

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

#if defined(FE_PIPE) || defined(FE_MMA)

#ifndef FE_STAGES
#define FE_STAGES 3
#endif
#ifndef FE_MINB
#define FE_MINB 4
#endif

#define FULL_MASK 0xffffffffu
#define ERR_LAUNCH 8
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// ---- work of one block: which heads, which keys, where the result goes ----------------------
//
// Two ways to cut a batch into blocks. Uniform partitions (the caller named a split count): grid.y
// = num_parts equal partitions of the longest possible context, so a short sequence's blocks
// finish at once and a ragged batch leaves SMs idle. Scheduled (the default): decode_plan cuts
// each sequence's visible keys into chunks of about one planned size (a long sequence into many,
// a short one into one), and block u of a grid sized for the most chunks a plan may make serves
// unit u = (chunk, heads) — work is split by keys over the whole batch, not by sequence.
//
// The schedule buffer (mirrored in cuda.rs `SchedLayout`): a header of SCHED_HEADER ints, then
// indptr[batch + 1] (sequence b's chunks are partial slots indptr[b] .. indptr[b + 1]), then
// items[max_items] as (sequence, chunk) pairs, then (16-byte aligned) the partials.
#define SCHED_HEADER 8
#define S_ITEMS 0  // chunks planned
#define S_CHUNK 3  // the planned chunk size in keys (for reports); ints 1, 2, 5..7 unused
#define S_ERR 4    // the error flag of runs on this schedule (cleared by each plan)
#define ERR_PLAN 16

// 32-bit fields: batch, heads and slots are all < 2³¹ (host-checked grids and buffer sizes).
struct Work {
  int b;           // sequence
  int kvh;         // kv head
  int h0;          // first query head of the block
  int start, end;  // keys [start, end)
  int slot;        // partial slot when nparts > 1
  int nparts;      // pieces of this sequence: 1 = the block writes o (and lse) itself
};

// Unit r0 of a sequence's hkv · (group / FE_G) blocks → its kv head and first query head.
__device__ __forceinline__ void unit_heads(int r0, i64 hq, i64 hkv, Work& w) {
  const int group = (int)hq / (int)hkv, nhb = group / FE_G;
  w.kvh = r0 / nhb;
  w.h0 = w.kvh * group + (r0 % nhb) * FE_G;
}

// Uniform partitions: grid.x = batch · hkv · nhb (≤ 2³¹−1, host-checked), grid.y = num_parts.
__device__ __forceinline__ bool uniform_work(const int* __restrict__ seq_lens, int* err, i64 batch,
                                             i64 hq, i64 hkv, int capacity, i64 window_left,
                                             i64 part_size, i64 num_parts, Work& w) {
  const int per_b = (int)hkv * ((int)hq / (int)hkv / FE_G);
  if ((i64)(blockIdx.x / per_b) >= batch) return false;
  w.b = (int)(blockIdx.x / per_b);
  unit_heads(blockIdx.x % per_b, hq, hkv, w);
  int lo, hi;
  key_range(seq_lens, w.b, capacity, window_left, err, lo, hi);
  w.start = lo, w.end = hi;
  w.nparts = (int)num_parts;
  w.slot = w.b * (int)num_parts + (int)blockIdx.y;
  if (num_parts > 1) {
    // part_size · num_parts ≤ capacity + part_size < 2³²: compute in 64 bits, clamp.
    const i64 s64 = (i64)lo + (i64)blockIdx.y * part_size;
    w.start = (int)min(s64, (i64)hi);
    w.end = (int)min(s64 + part_size, (i64)hi);
  }
  return true;
}

// Scheduled unit u = item · per_b + r0. The chunk's keys come from the sequence's length now, so a
// schedule planned for other lengths still covers every key (only the balance suffers); entries
// that cannot come from decode_plan for this batch are flagged (ERR_PLAN) and skipped.
__device__ __forceinline__ bool sched_work(const int* __restrict__ sched, i64 max_items, int u,
                                           int per_b, const int* __restrict__ seq_lens, int* err,
                                           i64 batch, i64 hq, i64 hkv, int capacity,
                                           i64 window_left, Work& w) {
  const int* indptr = sched + SCHED_HEADER;
  const int* items = indptr + batch + 1;
  const int item = u / per_b;
  const int b = items[2 * item], c = items[2 * item + 1];
  if (b < 0 || b >= batch) {
    atomicOr(err, ERR_PLAN);
    return false;
  }
  const int base = indptr[b], n = indptr[b + 1] - base;
  if (base < 0 || n < 1 || c < 0 || c >= n || (i64)base + n > max_items) {
    atomicOr(err, ERR_PLAN);
    return false;
  }
  w.b = b;
  unit_heads(u % per_b, hq, hkv, w);
  w.nparts = n;
  w.slot = base + c;
  int lo, hi;
  key_range(seq_lens, b, capacity, window_left, err, lo, hi);
  // Pieces of ⌈v / n⌉ keys rounded up to 16 (tile-aligned starts); the last may be short or empty.
  const i64 size = (((i64)(hi - lo) + n - 1) / n + 15) & ~(i64)15;
  const i64 s64 = (i64)lo + c * size;
  w.start = (int)min(s64, (i64)hi);
  w.end = (int)min(s64 + size, (i64)hi);
  return true;
}

// The number of scheduled units: chunks planned × units per chunk (0 and flagged when the
// header cannot come from decode_plan for this buffer).
__device__ __forceinline__ int sched_units(const int* __restrict__ sched, i64 max_items, int per_b,
                                           int* err) {
  const int n = sched[S_ITEMS];
  if (n < 0 || n > max_items) {
    if (threadIdx.x == 0) atomicOr(err, ERR_PLAN);
    return 0;
  }
  return n * per_b;
}

// The entry both scheduled kernels share: the dynamic shared memory check, then one unit —
// uniform partitions (sched == nullptr: grid.x = batch · hkv · (group / FE_G), grid.y = num_parts,
// partial slots batch · num_parts) or scheduled (block u serves unit u; blocks past the planned
// units return at once, and blocks start in index order as slots free up, so the chunks are dealt
// to SMs dynamically; err = sched + S_ERR, partial slots max_items).
template <typename Unit>
__device__ __forceinline__ void run_entry(Unit unit, unsigned smem_need, const int* seq_lens,
                                          int* err, i64 batch, i64 hq, i64 hkv, i64 block_size,
                                          i64 max_blocks, i64 window_left, i64 part_size,
                                          i64 num_parts, const int* sched, i64 max_items) {
  const bool smem_ok = dynamic_smem_bytes() >= smem_need;  // block-uniform
  if (!smem_ok && threadIdx.x == 0) atomicOr(err, ERR_LAUNCH);
  const int capacity = (int)(max_blocks * block_size);
  Work w;
  if (sched == nullptr) {
    if (smem_ok && uniform_work(seq_lens, err, batch, hq, hkv, capacity, window_left, part_size,
                                num_parts, w))
      unit(w, batch * num_parts);
    return;
  }
  const int per_b = (int)hkv * ((int)hq / (int)hkv / FE_G);
  const int u = blockIdx.x;
  if (smem_ok && u < sched_units(sched, max_items, per_b, err) &&
      sched_work(sched, max_items, u, per_b, seq_lens, err, batch, hq, hkv, capacity, window_left,
                 w))
    unit(w, max_items);
}

// A merged (head g, dim dd) value of the block: the output itself, or its partial in the slot.
// Partials: acc at part[(slot·hq + h)·FE_D + d], (max in the log2 domain, sum) at
// part[slots_total·hq·FE_D + (slot·hq + h)·2].
__device__ __forceinline__ void store_result(T* __restrict__ o, float* __restrict__ lse,
                                             float* __restrict__ part, i64 slots_total, i64 hq,
                                             const Work& w, int g, int dd, float av, float ls,
                                             float mx) {
  if (w.nparts == 1) {
    const i64 row = (i64)w.b * hq + w.h0 + g;
    o[row * FE_D + dd] = from_float<T>(av * inverse_or_zero(ls));
    if (dd == 0 && lse != nullptr) lse[row] = ls > 0.f ? (mx + log2f(ls)) * LN2 : NEG_INF;
  } else {
    const i64 pr = (i64)w.slot * hq + w.h0 + g;
    part[pr * FE_D + dd] = av;
    if (dd == 0) {
      float* ml = part + slots_total * hq * FE_D + pr * 2;
      ml[0] = mx;
      ml[1] = ls;
    }
  }
}

// Plan costs in units of one key streamed by one block (~0.1 µs at full bandwidth): a block's
// start (q, ring fill, warp merge), and the merge kernel when any sequence is split.
#define PLAN_BLOCK_KEYS 32
#define PLAN_MERGE_KEYS 64
#define PLAN_MIN_CHUNK 256   // fewest keys per chunk (mirrors PIPE_MIN_PART_KEYS)
#define PLAN_SATURATE 0.9f   // share of the resident blocks that already saturates HBM
#define PLAN_CANDIDATES 128  // chunk sizes tried: the longest range in 1 … 128 pieces

// Visible keys of sequence b for the plan (a bad length counts as 0; the decode kernel flags it).
__device__ __forceinline__ int plan_visible(const int* __restrict__ seq_lens, i64 b, i64 capacity,
                                            i64 window_left) {
  int len = seq_lens[b];
  if (len < 0 || len > capacity) len = 0;
  const int lo =
      (window_left >= 0 && (i64)len - 1 - window_left > 0) ? (int)(len - 1 - window_left) : 0;
  return len - lo;
}

// Chunks of `chunk` keys for v keys: at least one (an empty sequence still writes its o, lse).
__device__ __forceinline__ int chunks_of(int v, int chunk) { return v <= 0 ? 1 : (v + chunk - 1) / chunk; }

// The chunk size for the longest range `vmax` cut into `pieces`.
__device__ __forceinline__ int piece_keys(int vmax, int pieces) {
  return max(PLAN_MIN_CHUNK, ((vmax + pieces - 1) / pieces + 15) & ~15);
}

// decode_plan: one block of 256 threads plans a batch for the scheduled kernels. It models the run
// on `slots` resident blocks: a chunk size C costs max(C, all keys / (0.9 · slots)) in key-times
// when every block is resident at once, all keys / (0.9 · slots) + C when not (the wave tail),
// plus each block's start and, when any sequence is split, the merge; it takes the cheapest C among
// the longest range cut into 1 … 128 pieces (≥ 256 keys each, at most max_items chunks; ties:
// fewer pieces). A batch that already fills four waves (batch · per_b ≥ 4 · slots) is not split.
// Then every sequence gets ⌈v / C⌉ chunks (≥ 1), their prefix sums (indptr) and the
// (sequence, chunk) list in sequence order.
extern "C" __global__ void __launch_bounds__(256)
    decode_plan(int* __restrict__ sched, const int* __restrict__ seq_lens, i64 batch, i64 capacity,
                i64 window_left, i64 per_b, i64 slots, i64 max_items) {
  __shared__ int s_max[8];
  __shared__ unsigned long long s_sum[8];
  __shared__ float s_est[8];
  __shared__ int s_arg[8];
  __shared__ int s_scan[8];
  __shared__ int s_chunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* indptr = sched + SCHED_HEADER;
  int* items = indptr + batch + 1;

  // The longest visible range and the sum of all.
  int vmax = 0;
  unsigned long long vsum = 0;
  for (i64 b = tid; b < batch; b += 256) {
    const int v = plan_visible(seq_lens, b, capacity, window_left);
    vmax = max(vmax, v);
    vsum += (unsigned long long)v;
  }
  for (int off = 16; off > 0; off >>= 1) {
    vmax = max(vmax, __shfl_xor_sync(0xffffffffu, vmax, off));
    vsum += __shfl_xor_sync(0xffffffffu, vsum, off);
  }
  if (lane == 0) s_max[warp] = vmax, s_sum[warp] = vsum;
  __syncthreads();
  vmax = 0, vsum = 0;
  for (int i = 0; i < 8; ++i) vmax = max(vmax, s_max[i]), vsum += s_sum[i];

  // Candidates: warp w evaluates pieces w+1, w+9, …; its lanes split the batch.
  float best = POS_INF;
  int best_pieces = 1;
  const bool search = batch * per_b < 4 * slots && vmax > PLAN_MIN_CHUNK;
  for (int pieces = warp + 1; search && pieces <= PLAN_CANDIDATES; pieces += 8) {
    const int chunk = piece_keys(vmax, pieces);
    long long n = 0;
    for (i64 b = lane; b < batch; b += 32)
      n += chunks_of(plan_visible(seq_lens, b, capacity, window_left), chunk);
    for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(0xffffffffu, n, off);
    if (n > max_items) continue;
    // All blocks resident at once: the longest chunk, or the saturated stream of all the work.
    // More blocks than slots: the last one may start when the rest is done (chunks of one size
    // finish in waves), so a second wave costs a whole chunk more.
    const float work = (float)per_b * ((float)vsum + PLAN_BLOCK_KEYS * (float)n);
    const float fill = work / (PLAN_SATURATE * (float)slots);
    const float block = (float)(chunk + PLAN_BLOCK_KEYS);
    float est = (float)per_b * (float)n <= (float)slots ? fmaxf(block, fill) : fill + block;
    if (n > batch) est += PLAN_MERGE_KEYS;
    if (est < best) best = est, best_pieces = pieces;  // pieces ascend: ties keep fewer
  }
  if (lane == 0) s_est[warp] = best, s_arg[warp] = best_pieces;
  __syncthreads();
  if (tid == 0) {
    float e = POS_INF;
    int pieces = 1;
    for (int i = 0; i < 8; ++i)
      if (s_est[i] < e || (s_est[i] == e && s_arg[i] < pieces)) e = s_est[i], pieces = s_arg[i];
    // No search (or nothing fits): one chunk per sequence whatever its length.
    s_chunk = (!search || e == POS_INF) ? max(vmax, 1) : piece_keys(vmax, pieces);
  }
  __syncthreads();
  const int chunk = s_chunk;

  // Chunks per sequence → indptr (exclusive scan, 256 sequences per round) and the item list.
  int carry = 0;
  for (i64 base = 0; base < batch; base += 256) {
    const i64 b = base + tid;
    const int n = b < batch ? chunks_of(plan_visible(seq_lens, b, capacity, window_left), chunk) : 0;
    int x = n;  // inclusive scan in the warp
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (lane == 31) s_scan[warp] = x;
    __syncthreads();
    int before = carry, total = 0;
    for (int i = 0; i < 8; ++i) {
      if (i < warp) before += s_scan[i];
      total += s_scan[i];
    }
    const int first = before + x - n;
    if (b < batch) {
      indptr[b] = first;
      for (int c = 0; c < n && first + c < max_items; ++c) {
        items[2 * (first + c)] = (int)b;
        items[2 * (first + c) + 1] = c;
      }
    }
    carry += total;
    __syncthreads();  // s_scan is rewritten next round
  }
  if (tid == 0) {
    indptr[batch] = carry;
    // carry ≤ max_items by the search (a plan without splits has batch ≤ max_items chunks).
    sched[S_ITEMS] = min(carry, (int)max_items);
    sched[S_CHUNK] = chunk;
  }
}

#endif  // FE_PIPE || FE_MMA

#ifdef FE_PIPE

// Tile geometry. cuda.rs (pipe_tile_keys, pipe_smem_bytes) mirrors it to size the dynamic shared
// memory; the kernel refuses to run with less (ERR_LAUNCH).
constexpr int pow2_floor(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}
constexpr int GP = FE_G <= 1 ? 1 : FE_G <= 2 ? 2 : FE_G <= 4 ? 4 : 8;  // heads, padded to 2^n
constexpr int TK = cmax(KPW, cmin(32, pow2_floor(1024 / FE_D)));     // keys per warp tile
constexpr int R = TK / KPW;           // row steps per tile (a step: KPW keys, one per key group)
constexpr int P = R * GP;             // partial dot products per lane per tile
constexpr int E = TK * GP;            // (key, head) scores per tile
constexpr int EPL = (E + 31) / 32;    // of them per lane in the softmax step
constexpr int NOUT = P >= TPK ? P / TPK : 1;  // reduced scores a lane holds after halve_sum
constexpr int REP = P >= TPK ? 1 : TPK / P;   // lanes holding the same one
constexpr int CHUNKS = TK * NV;       // 16-byte vectors per K (or V) tile
constexpr int CPL = (CHUNKS + 31) / 32;
constexpr int TILE = TK * FE_D;       // elements per K (or V) tile
constexpr int RING_BYTES = FE_WARPS * FE_STAGES * 2 * TILE * (int)sizeof(T);
constexpr int EPI_BYTES = FE_WARPS * FE_G * (FE_D + 2) * 4;
constexpr int AREA_BYTES = cmax(RING_BYTES, EPI_BYTES);
constexpr int WS = (2 * E + GP + 3) / 4 * 4;  // floats of per-warp score scratch (16-byte rows)
constexpr int SMEM_BYTES = AREA_BYTES + FE_WARPS * WS * 4;
static_assert(FE_G >= 1 && FE_G <= 8, "the pipelined kernel serves 1 to 8 query heads per block");
static_assert(FE_STAGES >= 2, "a ring needs at least two stages");
static_assert(TK % KPW == 0 && TK <= 32 && TK >= 4, "tile keys: a multiple of the keys per step");
static_assert(AREA_BYTES % 16 == 0, "score scratch must stay 16-byte aligned");

// Sums v[0..N) over the TPK lanes of a key group (xor offsets OFF, OFF/2, …, 1) by recursive
// halving: at each offset a lane keeps one half of its values, sends the other half to its
// partner and adds what the partner sent for the kept half — N·(1 − 1/TPK) shuffles per lane
// instead of N·log2(TPK). `base` collects the halves kept: afterwards v[0..NOUT) hold the sums of
// the original v[base..base + NOUT). Once one value is left, the remaining offsets are plain
// butterflies (REP lanes then hold the same sum).
template <int N, int OFF>
__device__ __forceinline__ void halve_sum(float (&v)[P], int vi, int& base) {
  if constexpr (OFF > 0) {
    if constexpr (N == 1) {
      v[0] += __shfl_xor_sync(FULL_MASK, v[0], OFF);
      halve_sum<1, OFF / 2>(v, vi, base);
    } else {
      constexpr int H = N / 2;
      const bool up = (vi & OFF) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = up ? v[i] : v[i + H];
        const float keep = up ? v[i + H] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, OFF);
      }
      if (up) base += H;
      halve_sum<H, OFF / 2>(v, vi, base);
    }
  }
}

// GP consecutive floats of shared memory (16-byte aligned rows when GP ≥ 4).
__device__ __forceinline__ void load_heads(const float* p, float (&x)[GP]) {
  if constexpr (GP >= 4) {
#pragma unroll
    for (int g = 0; g < GP; g += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + g);
      x[g] = f.x, x[g + 1] = f.y, x[g + 2] = f.z, x[g + 3] = f.w;
    }
  } else if constexpr (GP == 2) {
    const float2 f = *reinterpret_cast<const float2*>(p);
    x[0] = f.x, x[1] = f.y;
  } else {
    x[0] = p[0];
  }
}

// step 4 — decode_pipelined. A block of FE_WARPS warps per unit of work (a sequence's keys
// [start, end), a kv head, FE_G query heads; see Work); each warp streams its own tiles of TK keys (tiles warp, warp + FE_WARPS,
// …) through a FE_STAGES-deep cp.async ring in shared memory, so FE_STAGES − 1 tiles of K and V
// (CPL 16-byte copies per lane each) are in flight while one is computed, however many registers
// the math takes. The table entries of the tile after next are loaded one iteration early, so
// issuing copies never waits on them. Per tile: lanes split the rows as in decode_gqa (TPK lanes
// × 8 dims per key) and form partial dot products for R row steps × GP heads, reduced over the
// key group by recursive halving (halve_sum), written as TK × GP scores; the softmax step gives
// each lane one (key, head) score, so the tile max, one rescale per tile (not per key) and exp2
// run once per score; then p·V accumulates in registers. All lanes of a warp share its running
// max, so its key groups merge by plain sums; warps merge through shared memory as in decode_gqa.
// Writes o (and lse) when the unit covers its whole sequence, else a partial (store_result) for
// decode_merge.
__device__ __forceinline__ void pipelined_unit(const Work& job, unsigned char* smem, T* __restrict__ o,
                                               float* __restrict__ lse, float* __restrict__ part,
                                               i64 slots_total, const T* __restrict__ q,
                                               const T* __restrict__ kc, const T* __restrict__ vc,
                                               const int* __restrict__ bt, int* err, i64 hq,
                                               i64 hkv, i64 num_blocks, i64 block_size,
                                               i64 max_blocks, float scale, float softcap,
                                               float inv_cap) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = lane / TPK, vi = lane % TPK;
  const unsigned bsz = (unsigned)block_size;
  const i64 b = job.b, h0 = job.h0;
  const int kvh = job.kvh, start = job.start, end = job.end;
  const int* bt_row = bt + b * max_blocks;

  float qf[GP][VEC];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    if (g < FE_G && (NV == TPK || vi < NV)) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(q + (b * hq + h0 + g) * FE_D + (i64)vi * VEC)),
              qf[g]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][e] = 0.f;
    }
  }
  float acc[FE_G][VEC];
#pragma unroll
  for (int g = 0; g < FE_G; ++g)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
  // Running max and sum of head lane % GP: the max is the same in every lane of that head, the
  // sum is this lane's share (summed over the head's lanes at the end).
  float m_run = NEG_INF, l_run = 0.f;

  T* ring = reinterpret_cast<T*>(smem) + warp * (FE_STAGES * 2 * TILE);
  float* sc = reinterpret_cast<float*>(smem + AREA_BYTES) + warp * WS;  // [TK][GP] scores
  float* ps = sc + E;                                                   // [TK][GP] weights
  float* al = ps + E;                                                   // [GP] rescale factors

  constexpr int TSTRIDE = FE_WARPS * TK;
  const int tile0 = start + warp * TK;  // this warp's first key; warp-uniform
  const int ntiles = end > tile0 ? (end - tile0 + TSTRIDE - 1) / TSTRIDE : 0;

  // Lane k < TK: the element offset of key k of this warp's tile i, and whether it counts (inside
  // the range, block entry valid — a bad entry is flagged and its key skipped).
  auto locate = [&](int i, i64& off) -> bool {
    off = 0;
    if (lane >= TK || i >= ntiles) return false;
    const int j = tile0 + i * TSTRIDE + lane;  // < end + TSTRIDE: no overflow (MAX_CAPACITY)
    if (j >= end) return false;
    const int blk = bt_row[(unsigned)j / bsz];
    if (blk < 0 || blk >= num_blocks) {
      atomicOr(err, ERR_BLOCK);
      return false;
    }
    off = (((i64)blk * bsz + (unsigned)j % bsz) * hkv + kvh) * FE_D;
    return true;
  };
  // Queues tile i's K and V rows into its ring stage (masked keys zero-filled); returns the
  // tile's key mask (bit k: key k counts).
  auto issue = [&](int i, i64 off, bool valid) -> unsigned {
    const unsigned mask = __ballot_sync(FULL_MASK, valid);
    T* ks = ring + (i % FE_STAGES) * (2 * TILE);
    const unsigned olo = (unsigned)off, ohi = (unsigned)((u64)off >> 32);
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int ch = lane + 32 * c;
      const int k = cmin(ch / NV, TK - 1);
      const u64 row = ((u64)__shfl_sync(FULL_MASK, ohi, k) << 32) | __shfl_sync(FULL_MASK, olo, k);
      const bool ok = (mask >> k) & 1u;
      if (CHUNKS % 32 == 0 || ch < CHUNKS) {
        const i64 src = ok ? (i64)row + (ch % NV) * VEC : 0;
        cp_async16(ks + ch * VEC, kc + src, ok);
        cp_async16(ks + TILE + ch * VEC, vc + src, ok);
      }
    }
    return mask;
  };

  // Prologue: the table entries of tiles 0..FE_STAGES−1 (independent loads), tiles
  // 0..FE_STAGES−2 queued.
  i64 offs[FE_STAGES];
  bool vals[FE_STAGES];
#pragma unroll
  for (int s = 0; s < FE_STAGES; ++s) vals[s] = locate(s, offs[s]);
  unsigned masks[FE_STAGES - 1];  // key masks of the queued, not yet computed tiles
#pragma unroll
  for (int s = 0; s < FE_STAGES - 1; ++s) {
    masks[s] = s < ntiles ? issue(s, offs[s], vals[s]) : 0u;
    cp_async_commit();
  }
  i64 off_n = offs[FE_STAGES - 1];
  bool val_n = vals[FE_STAGES - 1];

  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<FE_STAGES - 2>();  // this lane's copies of tile i have landed …
    __syncwarp();  // … and every lane's; also: all lanes are done with tile i − 1's stage
    const unsigned mk = masks[0];
#pragma unroll
    for (int s = 0; s + 1 < FE_STAGES - 1; ++s) masks[s] = masks[s + 1];
    masks[FE_STAGES - 2] =
        i + FE_STAGES - 1 < ntiles ? issue(i + FE_STAGES - 1, off_n, val_n) : 0u;
    cp_async_commit();  // (empty past the end: keeps the group count uniform)
    val_n = locate(i + FE_STAGES, off_n);

    const T* ks = ring + (i % FE_STAGES) * (2 * TILE);
    const T* vs = ks + TILE;

    // Scores: this lane's 8-dim partial dot products for R row steps × GP heads …
    float part_s[P];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float kf[VEC];
      if (NV == TPK || vi < NV) {
        unpack8(*reinterpret_cast<const uint4*>(ks + (r * KPW + kg) * FE_D + vi * VEC), kf);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        float dot = 0.f;
        if (g < FE_G) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot = fmaf(qf[g][e], kf[e], dot);
        }
        part_s[r * GP + g] = dot;
      }
    }
    // … summed over the key group, each lane left with NOUT of them.
    int base = 0;
    halve_sum<P, TPK / 2>(part_s, vi, base);
    if (REP == 1 || vi % REP == 0) {
#pragma unroll
      for (int j = 0; j < NOUT; ++j) {
        const int idx = base + j, r = idx / GP, g = idx % GP;
        sc[(r * KPW + kg) * GP + g] = part_s[j];
      }
    }
    __syncwarp();

    // Softmax step: lane ↔ score e = lane + 32·i = key·GP + head (head = lane % GP).
    float s[EPL], tmax = NEG_INF;
#pragma unroll
    for (int x = 0; x < EPL; ++x) {
      const int e = lane + 32 * x;
      s[x] = NEG_INF;
      if ((E % 32 == 0 || e < E) && ((mk >> (e / GP)) & 1u))
        s[x] = score_log2(sc[e], scale, softcap, inv_cap);
      tmax = fmaxf(tmax, s[x]);
    }
#pragma unroll
    for (int off = GP; off < 32; off <<= 1)
      tmax = fmaxf(tmax, __shfl_xor_sync(FULL_MASK, tmax, off));
    const float m_new = fmaxf(m_run, tmax);
    const float alpha = rescale(m_run, m_new);
    float psum = 0.f;
#pragma unroll
    for (int x = 0; x < EPL; ++x) {
      const int e = lane + 32 * x;
      const float p = s[x] == NEG_INF ? 0.f : exp2f(s[x] - m_new);
      if (E % 32 == 0 || e < E) ps[e] = p;
      psum += p;
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    if (lane < GP) al[lane] = alpha;
    __syncwarp();

    // p·V: one rescale of acc per tile, skipped (warp-uniformly) when no head's max grew.
    float a[GP];
    load_heads(al, a);
    bool grew = false;
#pragma unroll
    for (int g = 0; g < FE_G; ++g) grew |= a[g] != 1.f;
    if (grew) {
#pragma unroll
      for (int g = 0; g < FE_G; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] *= a[g];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int k = r * KPW + kg;
      float p[GP];
      load_heads(ps + k * GP, p);
      if (NV == TPK || vi < NV) {
        float vf[VEC];
        unpack8(*reinterpret_cast<const uint4*>(vs + k * FE_D + vi * VEC), vf);
#pragma unroll
        for (int g = 0; g < FE_G; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][e] = fmaf(p[g], vf[e], acc[g][e]);
      }
    }
  }
  cp_async_wait<0>();  // the trailing (empty or unused) groups

  // The warp's key groups share its running max: plain sums.
#pragma unroll
  for (int off = TPK; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < FE_G; ++g)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][e] += __shfl_xor_sync(FULL_MASK, acc[g][e], off);
  }
#pragma unroll
  for (int off = GP; off < 32; off <<= 1) l_run += __shfl_xor_sync(FULL_MASK, l_run, off);

  __syncthreads();  // every warp is done with its ring: the area becomes the merge buffer
  float* sm_acc = reinterpret_cast<float*>(smem);  // [FE_WARPS][FE_G][FE_D]
  float* sm_m = sm_acc + FE_WARPS * FE_G * FE_D;   // [FE_WARPS][FE_G]
  float* sm_l = sm_m + FE_WARPS * FE_G;
  if (kg == 0 && (NV == TPK || vi < NV)) {
#pragma unroll
    for (int g = 0; g < FE_G; ++g)
#pragma unroll
      for (int e = 0; e < VEC; ++e) sm_acc[(warp * FE_G + g) * FE_D + vi * VEC + e] = acc[g][e];
  }
  if (lane < FE_G) {  // lane g < GP holds head g's max and (now) its warp-wide sum
    sm_m[warp * FE_G + lane] = m_run;
    sm_l[warp * FE_G + lane] = l_run;
  }
  __syncthreads();

  // Merge the warps; one thread per (head, dim).
  for (int idx = threadIdx.x; idx < FE_G * FE_D; idx += FE_WARPS * 32) {
    const int g = idx / FE_D, dd = idx % FE_D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) mx = fmaxf(mx, sm_m[w * FE_G + g]);
    float ls = 0.f, av = 0.f;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) {
      const float c = rescale(sm_m[w * FE_G + g], mx);
      ls += sm_l[w * FE_G + g] * c;
      av += sm_acc[(w * FE_G + g) * FE_D + dd] * c;
    }
    store_result(o, lse, part, slots_total, hq, job, g, dd, av, ls, mx);
  }
}

// The pipelined kernel's entry. sched == nullptr: uniform partitions (grid.x = batch · hkv ·
// (group / FE_G), grid.y = num_parts, slots_total = batch · num_parts). Otherwise scheduled units
// (grid.x = max_items · hkv · (group / FE_G), err = sched + S_ERR, slots_total = max_items). blockDim.x = FE_WARPS · 32;
// dynamic shared memory ≥ SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(FE_WARPS * 32, FE_MINB)
    decode_pipelined(T* __restrict__ o, float* __restrict__ lse, float* __restrict__ part,
                     const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                     const int* __restrict__ bt, const int* __restrict__ seq_lens, int* err,
                     i64 batch, i64 hq, i64 hkv, i64 num_blocks, i64 block_size, i64 max_blocks,
                     float scale, float softcap, float inv_cap, i64 window_left, i64 part_size,
                     i64 num_parts, int* sched, i64 max_items) {
  extern __shared__ __align__(16) unsigned char smem[];
  const auto unit = [&](const Work& w, i64 slots_total) {
    pipelined_unit(w, smem, o, lse, part, slots_total, q, kc, vc, bt, err, hq, hkv, num_blocks,
                   block_size, max_blocks, scale, softcap, inv_cap);
  };
  run_entry(unit, (unsigned)SMEM_BYTES, seq_lens, err, batch, hq, hkv, block_size, max_blocks,
            window_left, part_size, num_parts, sched, max_items);
}

#endif  // FE_PIPE

#if defined(FE_PIPE) || defined(FE_MMA)

// Merges the partials of each (sequence, query head) row written by decode_pipelined or
// decode_mma: a block of 128 threads per row (grid-stride). Uniform partitions (sched ==
// nullptr): every row has num_parts partials in slots b·num_parts …; scheduled: sequence b's are
// slots indptr[b] … indptr[b + 1], and rows of sequences in one piece (written by the kernel
// itself) are skipped. The weights exp2(m_p − max) come from a block max; the parts are dealt to
// 128 / (FE_D/4) thread groups, each summing its parts' weighted float4 columns with independent
// loads in flight, and the groups meet in shared memory. The order of every sum is fixed: the
// result does not depend on which block computed which piece.
extern "C" __global__ void __launch_bounds__(128)
    decode_merge(T* __restrict__ o, float* __restrict__ lse, const float* __restrict__ part,
                 const int* __restrict__ sched, i64 batch, i64 hq, i64 num_parts,
                 i64 slots_total) {
  constexpr int C = FE_D / 4, NG = 128 / C;
  static_assert(FE_D % 4 == 0 && NG >= 1, "float4 columns");
  __shared__ float red[64];
  __shared__ float4 sacc[NG * C];
  const float* ml_all = part + slots_total * hq * FE_D;
  const int tid = threadIdx.x, col = tid % C, grp = tid / C;
  const i64 rows = batch * hq;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 b = row / hq, h = row % hq;
    i64 base = b * num_parts, n = num_parts;
    if (sched != nullptr) {
      const int* indptr = sched + SCHED_HEADER;
      base = indptr[b];
      n = indptr[b + 1] - base;
      if (n <= 1 || base < 0 || base + n > slots_total) continue;  // block-uniform
    }
    const float* ml = ml_all + (base * hq + h) * 2;  // part p's pair at ml[2·hq·p]
    const i64 mstep = 2 * hq;
    float mx = NEG_INF;
    for (i64 p = tid; p < n; p += 128) mx = fmaxf(mx, ml[mstep * p]);
    mx = block_max(mx, red);
    float ls = 0.f;
    for (i64 p = tid; p < n; p += 128) ls += ml[mstep * p + 1] * rescale(ml[mstep * p], mx);
    ls = block_sum(ls, red);
    if (grp < NG) {
      const float4* pa = reinterpret_cast<const float4*>(part + (base * hq + h) * FE_D) + col;
      const i64 astep = hq * C;  // float4s between consecutive parts of the row
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (i64 p = grp; p < n; p += NG) {
        const float w = rescale(ml[mstep * p], mx);
        const float4 v = pa[p * astep];
        a.x = fmaf(w, v.x, a.x);
        a.y = fmaf(w, v.y, a.y);
        a.z = fmaf(w, v.z, a.z);
        a.w = fmaf(w, v.w, a.w);
      }
      sacc[grp * C + col] = a;
    }
    __syncthreads();
    if (tid < C) {
      float4 t = sacc[tid];
#pragma unroll
      for (int g = 1; g < NG; ++g) {
        const float4 u = sacc[g * C + tid];
        t.x += u.x, t.y += u.y, t.z += u.z, t.w += u.w;
      }
      const float inv = inverse_or_zero(ls);
      T* orow = o + row * FE_D + 4 * tid;
      orow[0] = from_float<T>(t.x * inv);
      orow[1] = from_float<T>(t.y * inv);
      orow[2] = from_float<T>(t.z * inv);
      orow[3] = from_float<T>(t.w * inv);
    }
    if (tid == 0 && lse != nullptr) lse[row] = ls > 0.f ? (mx + log2f(ls)) * LN2 : NEG_INF;
    __syncthreads();  // sacc is rewritten for the next row
  }
}

#endif  // FE_PIPE || FE_MMA

#ifdef FE_MMA

constexpr bool IS_BF16 = IsBf16<T>::value;

// Tile geometry (mirrored by mma_smem_bytes in cuda.rs).
constexpr int MTK = 16;              // keys per warp tile: two n8 tiles of q·k, one k16 step of p·v
constexpr int RS = FE_D + 8;         // shared row stride (elements): +16 bytes, so the 8 rows an
                                     // ldmatrix reads fall in 8 distinct 16-byte bank groups
constexpr int KC = FE_D / 16;        // 16-dim chunks: k steps of q·k, m tiles of p·v
constexpr int MCHUNKS = MTK * NV;    // 16-byte vectors per K (or V) tile
constexpr int MCPL = (MCHUNKS + 31) / 32;
constexpr int MTILE = MTK * RS;      // elements per K (or V) tile
constexpr int M_RING_BYTES = FE_WARPS * FE_STAGES * 2 * MTILE * (int)sizeof(T);
constexpr int M_EPI_BYTES = FE_WARPS * FE_G * (FE_D + 2) * 4;
constexpr int M_SMEM_BYTES = cmax(M_RING_BYTES, M_EPI_BYTES);
static_assert(FE_D % 16 == 0 && FE_D <= 256, "the mma kernel takes head dims 16, 32, …, 256");
static_assert(FE_G >= 1 && FE_G <= 8, "query heads are the rows 0..7 of an m16 tile");
static_assert(FE_STAGES >= 2, "a ring needs at least two stages");

// step 5 — decode_mma: decode_pipelined's pipeline (per-warp cp.async rings, table entries one
// tile early, partitions planned by waves) with the arithmetic on tensor cores. Per warp tile of
// MTK = 16 keys, with gid = lane / 4 and tig = lane % 4 (the mma fragment coordinates):
//   S = Q·Kᵀ: m16n8k16 with the block's query heads as rows 0..FE_G−1 of A (rows 8..15 are zero
//     registers), two n8 tiles of 8 keys, K-dim = head dim: Q's A fragments stay in registers
//     (KC × 2 words), K's B fragments come from the ring by ldmatrix (a key's row is a B column).
//   The S accumulator gives lane (gid, tig) head gid's scores of keys 2·tig, 2·tig+1 (tile 0) and
//     8+2·tig, 9+2·tig (tile 1): one online-softmax step per tile — a 4-lane max, 4 exp2 per lane.
//   Oᵀ += Vᵀ·Pᵀ: m16n8k16 with dims as rows (KC m tiles), heads as the 8 columns, the 16 keys as
//     K-dim: Vᵀ's A fragments by ldmatrix.trans from the same rows, and Pᵀ's B fragment is exactly
//     the S accumulator (keys 2·tig.. of head gid) packed to 16 bits — no shuffles.
// q·k and p·v cost 3·KC mma + 2·KC ldmatrix per 16 keys instead of ~2·D·G FFMAs and 2·D unpacks
// per key, so issue no longer competes with the copies. p is rounded to the storage type before
// p·v (as in FlashAttention and the attention family's flash rung); its sum l stays fp32.
// One unit of work per call (see Work); outputs as decode_pipelined's (o and lse, or a partial).
__device__ __forceinline__ void mma_unit(const Work& job, unsigned char* smem, T* __restrict__ o,
                                         float* __restrict__ lse, float* __restrict__ part,
                                         i64 slots_total, const T* __restrict__ q,
                                         const T* __restrict__ kc, const T* __restrict__ vc,
                                         const int* __restrict__ bt, int* err, i64 hq, i64 hkv,
                                         i64 num_blocks, i64 block_size, i64 max_blocks,
                                         float scale, float softcap, float inv_cap) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const unsigned bsz = (unsigned)block_size;
  const i64 b = job.b, h0 = job.h0;
  const int kvh = job.kvh, start = job.start, end = job.end;
  const int* bt_row = bt + b * max_blocks;

  // Q's A fragments: a0 = Q[gid][16c + 2tig, +1], a2 = Q[gid][16c + 8 + 2tig, +1] (a1 = a3 = 0:
  // rows 8..15); zero for rows ≥ FE_G.
  unsigned qa[KC][2];
  {
    const unsigned* qrow =
        reinterpret_cast<const unsigned*>(q + (b * hq + h0 + (gid < FE_G ? gid : 0)) * FE_D);
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      qa[c][0] = gid < FE_G ? __ldg(qrow + 8 * c + tig) : 0u;
      qa[c][1] = gid < FE_G ? __ldg(qrow + 8 * c + 4 + tig) : 0u;
    }
  }
  // Oᵀ accumulators: oacc[m] = Oᵀ[16m + gid (+8 for [2], [3])][heads 2tig, 2tig+1].
  float oacc[KC][4];
#pragma unroll
  for (int m = 0; m < KC; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) oacc[m][e] = 0.f;
  // Head gid's running max (equal in its 4 lanes) and this lane's share of its sum.
  float m_run = NEG_INF, l_run = 0.f;

  T* ring = reinterpret_cast<T*>(smem) + warp * (FE_STAGES * 2 * MTILE);

  constexpr int TSTRIDE = FE_WARPS * MTK;
  const int tile0 = start + warp * MTK;  // this warp's first key; warp-uniform
  const int ntiles = end > tile0 ? (end - tile0 + TSTRIDE - 1) / TSTRIDE : 0;

  // Lane k < MTK: the element offset of key k of this warp's tile i, and whether it counts.
  auto locate = [&](int i, i64& off) -> bool {
    off = 0;
    if (lane >= MTK || i >= ntiles) return false;
    const int j = tile0 + i * TSTRIDE + lane;  // < end + TSTRIDE: no overflow (MAX_CAPACITY)
    if (j >= end) return false;
    const int blk = bt_row[(unsigned)j / bsz];
    if (blk < 0 || blk >= num_blocks) {
      atomicOr(err, ERR_BLOCK);
      return false;
    }
    off = (((i64)blk * bsz + (unsigned)j % bsz) * hkv + kvh) * FE_D;
    return true;
  };
  // Queues tile i's K and V rows into its ring stage (rows RS apart; masked keys zero-filled);
  // returns the tile's key mask.
  auto issue = [&](int i, i64 off, bool valid) -> unsigned {
    const unsigned mask = __ballot_sync(FULL_MASK, valid);
    T* ks = ring + (i % FE_STAGES) * (2 * MTILE);
    const unsigned olo = (unsigned)off, ohi = (unsigned)((u64)off >> 32);
#pragma unroll
    for (int c = 0; c < MCPL; ++c) {
      const int ch = lane + 32 * c;
      const int k = cmin(ch / NV, MTK - 1), v = ch % NV;
      const u64 row = ((u64)__shfl_sync(FULL_MASK, ohi, k) << 32) | __shfl_sync(FULL_MASK, olo, k);
      const bool ok = (mask >> k) & 1u;
      if (MCHUNKS % 32 == 0 || ch < MCHUNKS) {
        const i64 src = ok ? (i64)row + v * VEC : 0;
        cp_async16(ks + k * RS + v * VEC, kc + src, ok);
        cp_async16(ks + MTILE + k * RS + v * VEC, vc + src, ok);
      }
    }
    return mask;
  };

  i64 offs[FE_STAGES];
  bool vals[FE_STAGES];
#pragma unroll
  for (int s = 0; s < FE_STAGES; ++s) vals[s] = locate(s, offs[s]);
  unsigned masks[FE_STAGES - 1];
#pragma unroll
  for (int s = 0; s < FE_STAGES - 1; ++s) {
    masks[s] = s < ntiles ? issue(s, offs[s], vals[s]) : 0u;
    cp_async_commit();
  }
  i64 off_n = offs[FE_STAGES - 1];
  bool val_n = vals[FE_STAGES - 1];

  // ldmatrix row addresses (elements, relative to a tile): lane l feeds row l % 8 of matrix l / 8.
  // q·k, key tile t: matrices = dims 16c, 16c+8, 16c+16, 16c+24 of keys 8t..8t+7.
  const int k_off = (lane & 7) * RS + 8 * (lane >> 3);
  // p·v, m tile m: matrices = (keys 0–7, dims 16m), (0–7, 16m+8), (8–15, 16m), (8–15, 16m+8).
  const int v_off = ((lane & 7) + 8 * (lane >> 4)) * RS + 8 * ((lane >> 3) & 1);

  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<FE_STAGES - 2>();  // this lane's copies of tile i have landed …
    __syncwarp();  // … and every lane's; also: all lanes are done with tile i − 1's stage
    const unsigned mk = masks[0];
#pragma unroll
    for (int s = 0; s + 1 < FE_STAGES - 1; ++s) masks[s] = masks[s + 1];
    masks[FE_STAGES - 2] =
        i + FE_STAGES - 1 < ntiles ? issue(i + FE_STAGES - 1, off_n, val_n) : 0u;
    cp_async_commit();  // (empty past the end: keeps the group count uniform)
    val_n = locate(i + FE_STAGES, off_n);

    const T* ks = ring + (i % FE_STAGES) * (2 * MTILE);
    const T* vs = ks + MTILE;

    // S = Q·Kᵀ for keys 0–7 (sc[0]) and 8–15 (sc[1]).
    float sc[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[t][e] = 0.f;
#pragma unroll
      for (int c = 0; c < KC; c += 2) {
        const T* kp = ks + 8 * t * RS + k_off + 16 * c;
        if (c + 1 < KC) {
          unsigned kb[4];
          ldsm_x4(kb, kp);
          mma_m16n8k16<IS_BF16>(sc[t], {qa[c][0], 0u, qa[c][1], 0u}, kb[0], kb[1]);
          mma_m16n8k16<IS_BF16>(sc[t], {qa[c + 1][0], 0u, qa[c + 1][1], 0u}, kb[2], kb[3]);
        } else {  // odd KC: the last chunk alone (lanes 0–15 address its two matrices)
          unsigned kb[2];
          ldsm_x2(kb, kp);
          mma_m16n8k16<IS_BF16>(sc[t], {qa[c][0], 0u, qa[c][1], 0u}, kb[0], kb[1]);
        }
      }
    }

    // Online softmax over the tile: x = scores of head gid for keys 2tig, 2tig+1, 8+2tig, 9+2tig.
    float x[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
    float tmax = NEG_INF;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = 8 * (e >> 1) + 2 * tig + (e & 1);
      x[e] = (mk >> key) & 1u ? score_log2(x[e], scale, softcap, inv_cap) : NEG_INF;
      tmax = fmaxf(tmax, x[e]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(FULL_MASK, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(FULL_MASK, tmax, 2));
    const float m_new = fmaxf(m_run, tmax);
    const float alpha = rescale(m_run, m_new);
    float p[4], psum = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = x[e] == NEG_INF ? 0.f : exp2f(x[e] - m_new);
      psum += p[e];
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;

    // Rescale Oᵀ's columns (heads 2tig, 2tig+1) once per tile, skipped when no max grew.
    if (!__all_sync(FULL_MASK, alpha == 1.f)) {
      const float a0 = __shfl_sync(FULL_MASK, alpha, 8 * tig);
      const float a1 = __shfl_sync(FULL_MASK, alpha, 8 * tig + 4);
#pragma unroll
      for (int m = 0; m < KC; ++m) {
        oacc[m][0] *= a0;
        oacc[m][1] *= a1;
        oacc[m][2] *= a0;
        oacc[m][3] *= a1;
      }
    }

    // Oᵀ += Vᵀ·Pᵀ: Pᵀ's B fragment (k = keys 2tig.., n = head gid) is this lane's p.
    const unsigned pb0 = pack2<T>(p[0], p[1]), pb1 = pack2<T>(p[2], p[3]);
#pragma unroll
    for (int m = 0; m < KC; ++m) {
      unsigned va[4];
      ldsm_x4_t(va, vs + v_off + 16 * m);
      mma_m16n8k16<IS_BF16>(oacc[m], va, pb0, pb1);
    }
  }
  cp_async_wait<0>();  // the trailing (empty or unused) groups

  // Head gid's sum over its 4 lanes.
  l_run += __shfl_xor_sync(FULL_MASK, l_run, 1);
  l_run += __shfl_xor_sync(FULL_MASK, l_run, 2);

  __syncthreads();  // every warp is done with its ring: the area becomes the merge buffer
  float* sm_acc = reinterpret_cast<float*>(smem);  // [FE_WARPS][FE_G][FE_D]
  float* sm_m = sm_acc + FE_WARPS * FE_G * FE_D;   // [FE_WARPS][FE_G]
  float* sm_l = sm_m + FE_WARPS * FE_G;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * tig + j;
    if (h < FE_G) {
#pragma unroll
      for (int m = 0; m < KC; ++m) {
        sm_acc[(warp * FE_G + h) * FE_D + 16 * m + gid] = oacc[m][j];
        sm_acc[(warp * FE_G + h) * FE_D + 16 * m + 8 + gid] = oacc[m][2 + j];
      }
    }
  }
  if (tig == 0 && gid < FE_G) {
    sm_m[warp * FE_G + gid] = m_run;
    sm_l[warp * FE_G + gid] = l_run;
  }
  __syncthreads();

  // Merge the warps; one thread per (head, dim).
  for (int idx = threadIdx.x; idx < FE_G * FE_D; idx += FE_WARPS * 32) {
    const int g = idx / FE_D, dd = idx % FE_D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) mx = fmaxf(mx, sm_m[w * FE_G + g]);
    float ls = 0.f, av = 0.f;
#pragma unroll
    for (int w = 0; w < FE_WARPS; ++w) {
      const float c = rescale(sm_m[w * FE_G + g], mx);
      ls += sm_l[w * FE_G + g] * c;
      av += sm_acc[(w * FE_G + g) * FE_D + dd] * c;
    }
    store_result(o, lse, part, slots_total, hq, job, g, dd, av, ls, mx);
  }
}

// The mma kernel's entry: as decode_pipelined's (uniform partitions, or scheduled units); dynamic shared memory ≥ M_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(FE_WARPS * 32)
    decode_mma(T* __restrict__ o, float* __restrict__ lse, float* __restrict__ part,
               const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
               const int* __restrict__ bt, const int* __restrict__ seq_lens, int* err, i64 batch,
               i64 hq, i64 hkv, i64 num_blocks, i64 block_size, i64 max_blocks, float scale,
               float softcap, float inv_cap, i64 window_left, i64 part_size, i64 num_parts,
               int* sched, i64 max_items) {
  extern __shared__ __align__(16) unsigned char smem[];
  const auto unit = [&](const Work& w, i64 slots_total) {
    mma_unit(w, smem, o, lse, part, slots_total, q, kc, vc, bt, err, hq, hkv, num_blocks,
             block_size, max_blocks, scale, softcap, inv_cap);
  };
  run_entry(unit, (unsigned)M_SMEM_BYTES, seq_lens, err, batch, hq, hkv, block_size, max_blocks,
            window_left, part_size, num_parts, sched, max_items);
}

#endif  // FE_MMA
