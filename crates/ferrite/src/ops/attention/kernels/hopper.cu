// attention/hopper — the `hopper` rung: attention forward and backward on Hopper warpgroup MMA fed
// by TMA (sm_90a only; bf16 and f16, head dim 64 or 128) — the FlashAttention-3 design.
//
// What changes vs `flash` (mma.sync, 8 warps that all copy and compute, ldmatrix fragments):
// - Copies: one producer thread issues TMA box copies (`cp.async.bulk.tensor.4d`, coordinates
//   (d, row, head, batch) in a 4-D tensor map of each of q, k, v — any strides) into 128-byte
//   swizzled shared memory, counted in bytes on mbarriers; K and V of a tile land on separate
//   barriers, so S = Q·Kᵀ starts before V has arrived. A 2-stage ring of (K, V) tiles of 128 keys.
// - Math: `wgmma.mma_async` — S = Q·Kᵀ as m64n128k16 with both operands from shared memory
//   (K-major), then O += P·V as m64nDk16 with P taken straight from registers (the accumulator
//   of S, rounded to 16 bits, is already the register A-fragment layout) and V read MN-major
//   (the transpose bit). No ldmatrix, no fragment loads: the tensor cores read shared memory.
// - Warp specialisation: block = 3 warpgroups (384 threads), 128 query rows. Warpgroup 0 is the
//   producer (`setmaxnreg.dec`), warpgroups 1 and 2 are consumers (`setmaxnreg.inc` 240), 64 query
//   rows each, holding S (64 fp32), O (D/2 fp32) and P (32 registers) per thread. While one
//   consumer warpgroup runs its softmax on the CUDA cores, the other's wgmmas keep the tensor
//   cores busy.
// - Consumers release a stage (one arrival per warp on its `empty` barrier) after their P·V
//   wgmma completed; the producer refills it.
// Done since: intra-warpgroup overlap of softmax(j) with the GEMMs (FE_PIPE), ping-pong turns of
// the two consumer warpgroups (named barriers), and the backward on wgmma (FE_BWD, below).
// Not done yet (FA3's further steps): a TMA-store epilogue, FP8.
// Host emulation of every kernel here: scripts/hopper-emu (run.sh).
// Masking, soft-cap, GQA, varlen and the lse follow kernels/flash.cu exactly (same host Problem).

#include "hopper.cuh"
#include "mma.cuh"
#include "sfu.cuh"
using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM __nv_bfloat16
#endif
#ifndef FE_HEAD_DIM
#define FE_HEAD_DIM 128
#endif
#ifndef FE_WGMMA_BF16
#define FE_WGMMA_BF16 1
#endif
#if FE_WGMMA_BF16
#define FE_WG_TY "bf16"
#else
#define FE_WG_TY "f16"
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef FE_ELEM T;
constexpr int D = FE_HEAD_DIM;
static_assert(D == 64 || D == 128, "head dim 64 or 128");
#ifndef FE_STAGES
#define FE_STAGES 2
#endif
// 1: overlap the softmax of tile j+1 with P(j)·V(j) inside a warpgroup (FA3's intra-warpgroup
// pipelining); 0: one tile at a time per warpgroup (the two warpgroups still overlap each other).
#ifndef FE_PIPE
#define FE_PIPE 0
#endif
// Soft-capping compiled in (1) or out (0): the host picks the specialisation.
#ifndef FE_SOFTCAP
#define FE_SOFTCAP 0
#endif
// 1: this module holds the backward (attn_hopper_bwd) instead of the forward.
#ifndef FE_BWD
#define FE_BWD 0
#endif
constexpr int BM = 128, BN = 128, STAGES = FE_STAGES, NTHREADS = 384;
constexpr int DB = D / 64;  // d-boxes per tile: a box is 64 elements (128 B) of d wide
constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
constexpr int STAGE_BYTES = 2 * KV_BYTES;  // K then V
constexpr float LN2 = 0.6931471805599453f;

// Which tensor-map coordinate (1..3) carries the row, the head and the batch (the host orders a
// map's dims by stride).
struct MapOrder {
  int row, head, batch, pad;
};
struct ScoreMap {
  float scale_log2, cap_in, cap_out_log2;
  int capped;
};

__device__ __forceinline__ void tma_load4(unsigned dst, const TmaDesc* map, unsigned bar, int d0,
                                          const int (&c)[3]) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(d0), "r"(c[0]), "r"(c[1]), "r"(c[2])
      : "memory");
}
// The order blocks go out in (a 1-D grid of units × nblk; a unit is one (batch, head) pair, a
// unit's blocks are ranked by work, rank 0 the most under a causal mask). Blocks go chunk by
// chunk of `chunk` consecutive units and, inside a chunk, rank by rank across its units: every
// unit's heaviest block first, so the light ones fill the tail (longest-first), while the
// chunk's units (sized by the host to share L2) keep their K/V (forward) or Q/dO (backward)
// tiles in L2. chunk = 1 is the plain unit-by-unit order (the host's choice without a mask).
struct Sched {
  int unit, rank;
};
__device__ __forceinline__ Sched schedule(int units, int nblk, int chunk) {
  const unsigned per = (unsigned)chunk * (unsigned)nblk;
  const unsigned c = blockIdx.x / per, r = blockIdx.x - c * per;
  const unsigned cnt = min((unsigned)chunk, (unsigned)units - c * (unsigned)chunk);
  return Sched{(int)(c * chunk + r % cnt), (int)(r / cnt)};
}

// Warpgroup register budgets (setmaxnreg: the producer gives registers to the consumers).
// setmaxnreg moves registers between the warps of a block, within what the block was given at
// launch (384 threads × 168, the most __launch_bounds__(384, 1) allows): asking for more than
// the producer gave back leaves the consumers waiting in setmaxnreg.inc forever. 24 + 2 × 240
// warpgroup-registers per thread is exactly 3 × 168.
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= NTHREADS * (65536 / NTHREADS / 8 * 8),
              "setmaxnreg budgets exceed the block's launch allocation");

// d (64×128 fp32) (+)= A(64×16, smem desc da) · B(16×128, smem desc db, K-major); scale_d 0 zeroes d first.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d (64×128 fp32) += A(64×16, registers: the m16n8k16 A fragment of each warp's 16 rows) · B(16×128, smem desc db, MN-major).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const unsigned (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (64×64 fp32) += A(64×16, registers: the m16n8k16 A fragment of each warp's 16 rows) · B(16×64, smem desc db, MN-major).
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const unsigned (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}


// d (64×64 fp32) (+)= A(64×16, smem desc, K-major) · B(16×64, smem desc, K-major); scale_d 0 zeroes d first.
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d (64×64 fp32) (+)= A(64×16, smem desc, MN-major) · B(16×64, smem desc, MN-major); scale_d 0 zeroes d first.
__device__ __forceinline__ void wgmma_ss_tt_n64(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, %32, %33, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d (64×32 fp32) (+)= A(64×16, smem desc, MN-major) · B(16×32, smem desc, MN-major); scale_d 0 zeroes d first.
__device__ __forceinline__ void wgmma_ss_tt_n32(float (&d)[16], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." FE_WG_TY "." FE_WG_TY " {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, %16, %17, p, 1, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(scale_d));
}

constexpr int O_REGS = D / 2;
__device__ __forceinline__ void wgmma_pv(float (&o)[O_REGS], const unsigned (&a)[4], u64 db) {
#if FE_HEAD_DIM == 128
  wgmma_rs_n128(o, a, db);
#else
  wgmma_rs_n64(o, a, db);
#endif
}

struct Seq {
  i64 start, len;
};
__device__ __forceinline__ Seq seq_of(const int* cu, int b, int max_len) {
  if (cu == nullptr) return Seq{0, max_len};
  const int s0 = cu[b], s1 = cu[b + 1];
  return Seq{s0, s1 - s0};
}
// Tensor-map coordinates (row, head, batch) placed in the map's dim order.
__device__ __forceinline__ void coords(const MapOrder& o, int row, int head, int batch, int (&c)[3]) {
  c[o.row - 1] = row;
  c[o.head - 1] = head;
  c[o.batch - 1] = batch;
}

#if !FE_BWD
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
attn_hopper_fwd(const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,
                const __grid_constant__ TmaDesc tv, MapOrder oq, MapOrder okv, T* __restrict__ o,
                float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                int hq, int hkv, int max_sq, int max_sk, i64 os_b, i64 os_s, i64 os_h,
                i64 lse_rows, i64 wl, i64 wr, ScoreMap smap, int units, int nblk, int chunk) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + 1023) & ~1023u;  // 128B swizzle atoms are 1024-byte aligned
  const unsigned sq_s = base;                   // Q: DB boxes of [BM][64]
  const unsigned kv0 = base + Q_BYTES;          // stage s: K at kv0 + s·STAGE_BYTES, V after it
  const unsigned bars = kv0 + STAGES * STAGE_BYTES;
  const unsigned qbar = bars;                   // then kfull[s], vfull[s], empty[s]
  auto kfull = [&](int s) { return bars + 8 + 8 * s; };
  auto vfull = [&](int s) { return bars + 8 + 8 * STAGES + 8 * s; };
  auto empty = [&](int s) { return bars + 8 + 16 * STAGES + 8 * s; };

  const Sched sc = schedule(units, nblk, chunk);  // units: (batch, query head)
  const int b = sc.unit / hq, h = sc.unit % hq, hk = h / (hq / hkv);
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  const i64 m0 = (i64)(nblk - 1 - sc.rank) * BM;  // the last query rows see the most keys
  if (m0 >= sq.len) return;
  const i64 off = sk.len - sq.len;
  i64 lo = wl >= 0 ? max((i64)0, m0 + off - wl) : 0;
  i64 hi = wr >= 0 ? min(sk.len, min(m0 + BM, sq.len) - 1 + off + wr + 1) : sk.len;
  const int nb_lo = (int)(lo / BN);
  const int ntiles = hi > lo ? (int)((hi + BN - 1) / BN) - nb_lo : 0;

  if (threadIdx.x == 0) {
    mbar_init(qbar, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(kfull(s), 1);
      mbar_init(vfull(s), 1);
      mbar_init(empty(s), 8);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
    regs_dec<PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      // Padded batches index rows within the sequence and pick the batch by coordinate; varlen
      // rows are absolute in the packed dim (batch coordinate 0).
      const int qb = cu_q ? 0 : b, kb = cu_k ? 0 : b;
      int c[3];
      coords(oq, (int)(sq.start + m0), h, qb, c);
      mbar_expect_tx(qbar, Q_BYTES);
#pragma unroll
      for (int db = 0; db < DB; ++db) tma_load4(sq_s + db * BM * 128, &tq, qbar, db * 64, c);
      int s = 0;
      unsigned ph = 0;
      for (int it = 0; it < ntiles; ++it) {
        mbar_wait(empty(s), ph ^ 1);
        const unsigned ks = kv0 + s * STAGE_BYTES, vs = ks + KV_BYTES;
        coords(okv, (int)(sk.start + (i64)(nb_lo + it) * BN), hk, kb, c);
        mbar_expect_tx(kfull(s), KV_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) tma_load4(ks + db * BN * 128, &tk, kfull(s), db * 64, c);
        mbar_expect_tx(vfull(s), KV_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) tma_load4(vs + db * BN * 128, &tv, vfull(s), db * 64, c);
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup c owns query rows 64c..64c+63 of the block ----
  regs_inc<CONSUMER_REGS>();
  const int c = wg - 1;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const int g = lane >> 2, t = lane & 3;
  const i64 row_g = m0 + c * 64 + warp * 16 + g;  // this thread's rows: row_g, row_g + 8

  float acc[O_REGS];
#pragma unroll
  for (int i = 0; i < O_REGS; ++i) acc[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const i64 pos_min = m0 + off, pos_max = min(m0 + BM, sq.len) - 1 + off;
  mbar_wait(qbar, 0);

  // Pipelined over key tiles (FA3's intra-warpgroup overlap): while the tensor cores run
  // O += P(j)·V(j) and S(j+1) = Q·K(j+1)ᵀ, this warpgroup runs the softmax of S(j+1) on the CUDA
  // cores; O is rescaled once P(j)·V(j) has completed.
  auto stage_k = [&](int it) { return kv0 + (it % STAGES) * STAGE_BYTES; };
  auto parity = [&](int it) { return (unsigned)((it / STAGES) & 1); };
  auto issue_s = [&](float (&sc)[64], int it) {
    const unsigned ks = stage_k(it);
    mbar_wait(kfull(it % STAGES), parity(it));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const u64 da = smem_desc(sq_s + (kk / 4) * BM * 128 + c * 64 * 128 + (kk % 4) * 32, 16, 1024);
      const u64 db = smem_desc(ks + (kk / 4) * BN * 128 + (kk % 4) * 32, 16, 1024);
      wgmma_ss_n128(sc, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](const unsigned (&pa)[8][4], int it) {
    const unsigned vs = stage_k(it) + KV_BYTES;
    mbar_wait(vfull(it % STAGES), parity(it));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma_pv(acc, pa[kk], smem_desc(vs + kk * 2048, BN * 128, 1024));
    wgmma_commit();
  };
  // Softmax of tile `it` in place: masks, updates the running max and sum, writes P as register
  // A fragments into pa and the factor the output must be rescaled by into alpha.
  auto softmax = [&](float (&sc)[64], int it, unsigned (&pa)[8][4], float (&alpha)[2]) {
    const i64 n0 = (i64)(nb_lo + it) * BN;
    const bool full = n0 + BN <= sk.len && (wl < 0 || n0 >= pos_max - wl) &&
                      (wr < 0 || n0 + BN - 1 <= pos_min + wr);
    // Without soft-cap the scale is folded into the exponent: p = 2^(s·c − max·c), one FFMA.
    const float mul = FE_SOFTCAP ? 1.f : smap.scale_log2;
    if (FE_SOFTCAP) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sc[i] = smap.cap_out_log2 * tanh_approx(sc[i] * smap.cap_in);
    }
    // The tile's test is uniform: taken once, not per element (inside the unrolled loop it
    // compiled to a branch per element, 64 per tile, taken on every full tile too); the masked
    // path is branch-free.
    if (!full) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 i = row_g + (e >> 1) * 8, jj = n0 + 8 * j + 2 * t + (e & 1);
          const i64 pos = i + off;
          const bool ok = (jj < sk.len) & ((wl < 0) | (jj >= pos - wl)) & ((wr < 0) | (jj <= pos + wr));
          sc[4 * j + e] = ok ? sc[4 * j + e] : -INFINITY;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx * mul, m_run[r]);                // running max, log2 domain
      const float bse = mx == -INFINITY ? 0.f : mx;  // nothing visible yet: P = 0, keep O
      alpha[r] = ex2_approx(m_run[r] - bse);
      m_run[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        sc[4 * j + 2 * r] = ex2_approx(fmaf(sc[4 * j + 2 * r], mul, -bse));
        sc[4 * j + 2 * r + 1] = ex2_approx(fmaf(sc[4 * j + 2 * r + 1], mul, -bse));
        sum += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
      }
      l_run[r] = l_run[r] * alpha[r] + sum;
    }
    // k-step kk covers keys 16kk..16kk+15 = accumulator chunks 2kk, 2kk+1.
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      pa[kk][0] = pack2<T>(sc[8 * kk + 0], sc[8 * kk + 1]);
      pa[kk][1] = pack2<T>(sc[8 * kk + 2], sc[8 * kk + 3]);
      pa[kk][2] = pack2<T>(sc[8 * kk + 4], sc[8 * kk + 5]);
      pa[kk][3] = pack2<T>(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
  };
  // Skipped when no row of the warp saw its max grow (common once the max has settled).
  auto rescale = [&](const float (&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int j = 0; j < O_REGS / 4; ++j) {
      acc[4 * j + 0] *= alpha[0];
      acc[4 * j + 1] *= alpha[0];
      acc[4 * j + 2] *= alpha[1];
      acc[4 * j + 3] *= alpha[1];
    }
  };

#if !FE_PIPE
  // Plain order per tile: S = Q·Kᵀ, wait, softmax, rescale O, O += P·V, wait, release.
  for (int it = 0; it < ntiles; ++it) {
    float sc[64];
    unsigned pa[8][4];
    float alpha[2];
    issue_s(sc, it);
    wgmma_wait<0>();
    acc_fence(sc);
    softmax(sc, it, pa, alpha);
    rescale(alpha);
    issue_pv(pa, it);
    wgmma_wait<0>();
    acc_fence(acc);
    if (lane == 0) mbar_arrive(empty(it % STAGES));
  }
#else
  if (ntiles > 0) {
    float sc[64];
    unsigned pa[8][4], pn[8][4];
    float alpha[2];
    // Ping-pong (FA3): the two consumer warpgroups take turns issuing their wgmmas (named
    // barriers 1 and 2), so one's softmax runs while the other's GEMMs hold the tensor cores.
    // Warpgroup 0 goes first; each hands the turn over after issuing.
    auto turn_begin = [&]() { named_sync(1 + c, 256); };
    auto turn_end = [&](bool hand_over) {
      if (hand_over) named_arrive(2 - c, 256);
    };
    if (c == 1) turn_end(true);
    turn_begin();
    issue_s(sc, 0);
    turn_end(true);
    wgmma_wait<0>();
    acc_fence(sc);
    softmax(sc, 0, pa, alpha);  // O is still 0: no rescale needed
    // One step: S(it) and P(it−1)·V(it−1) in flight, softmax(it) into `next` while `cur` is
    // still being read by the tensor cores — so P is double-buffered, never overwritten in flight.
    auto step = [&](int it, const unsigned (&cur)[8][4], unsigned (&next)[8][4]) {
      turn_begin();
      issue_s(sc, it);
      issue_pv(cur, it - 1);
      turn_end(true);
      wgmma_wait<1>();  // S(it) has landed; P(it−1)·V(it−1) may still run
      acc_fence(sc);
      softmax(sc, it, next, alpha);
      wgmma_wait<0>();
      acc_fence(acc);
      if (lane == 0) mbar_arrive(empty((it - 1) % STAGES));
      rescale(alpha);
    };
    for (int it = 1; it < ntiles; it += 2) {
      step(it, pa, pn);
      if (it + 1 < ntiles) step(it + 1, pn, pa);
    }
    // P of the last tile is in pa when its index is even.
    turn_begin();
    if ((ntiles - 1) % 2 == 0)
      issue_pv(pa, ntiles - 1);
    else
      issue_pv(pn, ntiles - 1);
    turn_end(c == 0);  // warpgroup 1 takes the last turn: nobody waits for its hand-over
    wgmma_wait<0>();
    acc_fence(acc);
    if (lane == 0) mbar_arrive(empty((ntiles - 1) % STAGES));
  }
#endif

  // Normalise and store (32-bit stores of column pairs), lse by the quad's lane 0.
  const i64 obase = (cu_q ? 0 : (i64)b * os_b) + sq.start * os_s + (i64)h * os_h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const i64 row = row_g + r * 8;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (row < sq.len) {
      T* orow = o + obase + row * os_s;
#pragma unroll
      for (int j = 0; j < O_REGS / 4; ++j)
        *reinterpret_cast<unsigned*>(orow + 8 * j + 2 * t) =
            pack2<T>(acc[4 * j + 2 * r] * inv, acc[4 * j + 2 * r + 1] * inv);
      if (t == 0) {
        const float val = l > 0.f ? (m_run[r] + log2f(l)) * LN2 : -INFINITY;
        const i64 idx = cu_q ? (i64)h * lse_rows + sq.start + row
                             : ((i64)b * hq + h) * (i64)max_sq + row;
        lse[idx] = val;
      }
    }
  }
}
#endif  // !FE_BWD

#if FE_BWD
// ---------------------------------------------------------------------------------------------
// attn_hopper_bwd — the backward on wgmma (FlashAttention-3's layout of the work), after Δ
// (flash_bwd_dot) and into a zeroed f32 dQ accumulator (flash_bwd_dq_convert finishes dq).
//
// A block owns 128 keys of one (sequence, kv head) and loops over every query head of its GQA
// group and every 64-query tile that can see those keys: per step it recomputes
//   Sᵀ = K·Qᵀ, Pᵀ = exp(Sᵀ·scale − lse), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)
// and accumulates dV += Pᵀ·dO, dK += dSᵀ·Q in registers (summed over the group in a fixed order:
// dK and dV are deterministic), and adds dQ_tile = dS·K into the accumulator with red.global.
// What changes vs `flash_bwd_fused` (mma.sync, 4 warps × 16 keys, ldmatrix fragments):
// - 3 warpgroups: warpgroup 0 produces (thread 0 issues the TMA copies of K and V once and of
//   each step's Q and dO tiles into 128-byte swizzled shared memory, a ring of FE_STAGES; warp 1
//   stages the step's lse·log2e and Δ in shared memory), warpgroups 1 and 2 each own 64 of the
//   128 keys and issue wgmma: Sᵀ and dPᵀ as m64n64 with both operands in shared memory, dV and
//   dK as m64nD with Pᵀ / dSᵀ straight from the accumulator registers (as the forward's P·V);
//   no ldmatrix and no fragment loads.
// - dQ_tile = dS·K needs all 128 keys of dS: each warpgroup writes its dSᵀ (16-bit, the rounding
//   the dK product uses) into a swizzled [128 keys][64 queries] tile, one named barrier joins the
//   two, and warpgroup c computes columns [c·D/2, (c+1)·D/2) of dQ_tile from that tile (A read
//   MN-major) and K (B read MN-major), then adds them with red.global.add.v2.f32: each dQ
//   element gets one addition per 128-key block (FlashAttention-2's count at 128-key blocks,
//   half of `flash_bwd_fused`'s at 64). The dSᵀ tile is double-buffered by step parity: a
//   warpgroup rewrites a buffer only after the next step's barrier, which the other warpgroup
//   reaches only after its wgmmas reading the buffer have completed.
// Masking and sequence edges as in the forward; a query column past its sequence end (the TMA
// tile then holds the next sequence's rows or zeros) is masked, so its Pᵀ and dSᵀ are 0.
#ifndef FE_BWD_STAGES
#define FE_BWD_STAGES 2
#endif
constexpr int B_BN = 128, B_BM = 64, B_STAGES = FE_BWD_STAGES;
// Named barriers of the backward: 1 joins the consumer warps; ROWS_BAR + s hands stage s's lse/Δ
// rows back from the consumers (arrive) to the warp that rewrites them (sync).
constexpr int ROWS_BAR = 2, ROWS_BAR_THREADS = 256 + 32;
static_assert(ROWS_BAR + B_STAGES <= 16, "named barrier ids");
constexpr int B_K_BYTES = B_BN * D * 2, B_Q_BYTES = B_BM * D * 2;
constexpr int B_STAGE_BYTES = 2 * B_Q_BYTES;  // Q then dO
constexpr int B_DS_BYTES = B_BN * B_BM * 2;   // one dSᵀ tile: 128 rows of 64 × 16 bits = 128 B
constexpr int DQ_N = D / 2;                   // dQ columns per consumer warpgroup
constexpr int DQ_REGS = DQ_N / 2;
constexpr float B_LOG2E = 1.4426950408889634f;

__device__ __forceinline__ void wgmma_dq(float (&d)[DQ_REGS], u64 da, u64 db, int scale_d) {
#if FE_HEAD_DIM == 128
  wgmma_ss_tt_n64(d, da, db, scale_d);
#else
  wgmma_ss_tt_n32(d, da, db, scale_d);
#endif
}
__device__ __forceinline__ float2 lds_f2(unsigned a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
  return v;
}

// The query rows [lo, hi) that can see some key of [n0, n1) (bottom-right aligned mask).
struct QRange {
  i64 lo, hi;
};
__device__ __forceinline__ QRange query_range(i64 n0, i64 n1, i64 off, i64 sq, i64 wl, i64 wr) {
  const i64 lo = wr >= 0 ? max((i64)0, n0 - off - wr) : 0;
  const i64 hi = wl >= 0 ? min(sq, n1 - 1 - off + wl + 1) : sq;
  return QRange{lo, hi > lo ? hi : lo};
}

// lse·log2e and Δ of query rows, indexed like lse: padded [B, Hq, Sq], varlen [Hq, total_q].
__device__ __forceinline__ i64 row_index(const int* cu_q, int b, int h, int hq, int max_sq,
                                         i64 lse_rows, const Seq& sq, i64 row) {
  return cu_q ? (i64)h * lse_rows + sq.start + row : ((i64)b * hq + h) * (i64)max_sq + row;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
attn_hopper_bwd(const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk,
                const __grid_constant__ TmaDesc tv, const __grid_constant__ TmaDesc tdo,
                MapOrder oq, MapOrder odo, MapOrder okv, const float* __restrict__ lse,
                const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                float* __restrict__ dq_acc, const int* __restrict__ cu_q,
                const int* __restrict__ cu_k, int hq, int hkv, int max_sq, int max_sk,
                i64 ks_b, i64 ks_s, i64 ks_h, i64 vs_b, i64 vs_s, i64 vs_h, i64 lse_rows, i64 wl,
                i64 wr, float scale_log2, float scale, int units, int nblk, int chunk) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const unsigned k_s = base, v_s = base + B_K_BYTES;
  const unsigned st0 = v_s + B_K_BYTES;                 // stage s: Q, then dO
  const unsigned ds0 = st0 + B_STAGES * B_STAGE_BYTES;  // dSᵀ tiles (2)
  const unsigned rows0 = ds0 + 2 * B_DS_BYTES;          // stage s: lse·log2e[64], Δ[64]
  const unsigned bars = rows0 + B_STAGES * 2 * B_BM * 4;
  const unsigned kvbar = bars;
  auto full = [&](int s) { return bars + 8 + 8 * s; };
  auto empty = [&](int s) { return bars + 8 + 8 * B_STAGES + 8 * s; };
  auto q_tile = [&](int s) { return st0 + s * B_STAGE_BYTES; };
  auto rows_of = [&](int s) { return rows0 + s * 2 * B_BM * 4; };

  const Sched sc = schedule(units, nblk, chunk);  // units: (batch, kv head)
  const int b = sc.unit / hkv, hk = sc.unit % hkv, group = hq / hkv;
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  const i64 n0 = (i64)sc.rank * B_BN;  // the first keys are seen by the most query rows
  if (n0 >= sk.len) return;
  const i64 off = sk.len - sq.len;
  const QRange qr = query_range(n0, min(n0 + B_BN, sk.len), off, sq.len, wl, wr);
  const int mb_lo = (int)(qr.lo / B_BM);
  const int mtiles = qr.hi > qr.lo ? (int)((qr.hi + B_BM - 1) / B_BM) - mb_lo : 0;
  const int steps = group * mtiles;  // (query head of the group, query tile), head-major

  if (threadIdx.x == 0) {
    mbar_init(kvbar, 1);
    for (int s = 0; s < B_STAGES; ++s) {
      mbar_init(full(s), 33);   // the TMA thread's expect_tx + every lane of the lse/Δ warp
      mbar_init(empty(s), 8);   // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
    regs_dec<PRODUCER_REGS>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
      const int qb = cu_q ? 0 : b, kb = cu_k ? 0 : b;
      int c[3];
      coords(okv, (int)(sk.start + n0), hk, kb, c);
      mbar_expect_tx(kvbar, 2 * B_K_BYTES);
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        tma_load4(k_s + db * B_BN * 128, &tk, kvbar, db * 64, c);
        tma_load4(v_s + db * B_BN * 128, &tv, kvbar, db * 64, c);
      }
      int s = 0, mi = 0, h = hk * group;
      unsigned ph = 0;
      int co[3];
      for (int it = 0; it < steps; ++it) {
        mbar_wait(empty(s), ph ^ 1);
        const int row = (int)(sq.start + (i64)(mb_lo + mi) * B_BM);
        coords(oq, row, h, qb, c);
        coords(odo, row, h, qb, co);
        mbar_expect_tx(full(s), B_STAGE_BYTES);
#pragma unroll
        for (int db = 0; db < DB; ++db) {
          tma_load4(q_tile(s) + db * B_BM * 128, &tq, full(s), db * 64, c);
          tma_load4(q_tile(s) + B_Q_BYTES + db * B_BM * 128, &tdo, full(s), db * 64, co);
        }
        if (++mi == mtiles) {
          mi = 0;
          ++h;
        }
        if (++s == B_STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    } else if (warp == 1) {
      int s = 0, mi = 0, h = hk * group;
      unsigned ph = 0;
      for (int it = 0; it < steps; ++it) {
        mbar_wait(empty(s), ph ^ 1);
        // The consumers' reads of these rows from step it - B_STAGES are done (their
        // named_arrive): a barrier every thread passes, so the write-after-read order is one
        // compute-sanitizer racecheck follows (it does not see through a warp's single mbarrier
        // arrival after __syncwarp).
        if (it >= B_STAGES) named_sync(ROWS_BAR + s, ROWS_BAR_THREADS);
        const i64 m0 = (i64)(mb_lo + mi) * B_BM;
        float* rs = reinterpret_cast<float*>(smem_raw + (rows_of(s) - smem_u32(smem_raw)));
#pragma unroll
        for (int r = lane; r < B_BM; r += 32) {
          const i64 row = m0 + r;
          float l = 0.f, dl = 0.f;
          if (row < sq.len) {
            const i64 idx = row_index(cu_q, b, h, hq, max_sq, lse_rows, sq, row);
            l = lse[idx] * B_LOG2E;
            dl = delta[idx];
          }
          rs[r] = l;
          rs[B_BM + r] = dl;
        }
        // Each lane releases its own writes (compute-sanitizer racecheck does not follow one
        // lane's arrival after a __syncwarp as releasing the other lanes' stores).
        mbar_arrive(full(s));
        if (++mi == mtiles) {
          mi = 0;
          ++h;
        }
        if (++s == B_STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup c owns keys n0 + 64c .. n0 + 64c + 63 ----
  regs_inc<CONSUMER_REGS>();
  const int c = wg - 1;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const int g = lane >> 2, t = lane & 3;
  const int key_l = c * 64 + warp * 16 + g;  // this thread's keys: n0 + key_l, n0 + key_l + 8

  float dv_acc[O_REGS], dk_acc[O_REGS];
#pragma unroll
  for (int i = 0; i < O_REGS; ++i) {
    dv_acc[i] = 0.f;
    dk_acc[i] = 0.f;
  }
  // Descriptor start addresses that do not change between steps.
  const unsigned k_a = k_s + c * 64 * 128, v_a = v_s + c * 64 * 128;  // A of Sᵀ / dPᵀ (K-major)
#if FE_HEAD_DIM == 128
  const unsigned k_dq = k_s + c * B_BN * 128;  // B of dQ: d-box c of K (MN-major)
#else
  const unsigned k_dq = k_s + c * DQ_N * 2;    // B of dQ: the d-half c inside K's one box
#endif
  mbar_wait(kvbar, 0);

  int mi = 0, h = hk * group;
  for (int it = 0; it < steps; ++it) {
    const int s = it % B_STAGES;
    const unsigned qs = q_tile(s), dos = qs + B_Q_BYTES, rs = rows_of(s);
    const unsigned ds = ds0 + (it & 1) * B_DS_BYTES;
    const i64 m0 = (i64)(mb_lo + mi) * B_BM;
    mbar_wait(full(s), (unsigned)((it / B_STAGES) & 1));

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64 keys × 64 queries each), both operands K-major.
    float st[32], dp[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned ko = (kk / 4) * B_BN * 128 + (kk % 4) * 32;
      const unsigned qo = (kk / 4) * B_BM * 128 + (kk % 4) * 32;
      wgmma_ss_n64(st, smem_desc(k_a + ko, 16, 1024), smem_desc(qs + qo, 16, 1024), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned ko = (kk / 4) * B_BN * 128 + (kk % 4) * 32;
      const unsigned qo = (kk / 4) * B_BM * 128 + (kk % 4) * 32;
      wgmma_ss_n64(dp, smem_desc(v_a + ko, 16, 1024), smem_desc(dos + qo, 16, 1024), kk > 0);
    }
    wgmma_commit();

    // This thread's 16 query columns: 8j + 2t + {0, 1}.
    float2 lq[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) lq[j] = lds_f2(rs + (8 * j + 2 * t) * 4);
    const bool full_tile = m0 + B_BM <= sq.len && n0 + B_BN <= sk.len &&
                           (wl < 0 || n0 >= m0 + B_BM - 1 + off - wl) &&
                           (wr < 0 || n0 + B_BN - 1 <= m0 + off + wr);

    wgmma_wait<1>();
    acc_fence(st);
    // Pᵀ in place of Sᵀ. The tile's test is uniform, so it is taken once: inside the unrolled
    // loop the compiler kept a branch (and a convergence barrier) per element.
    if (full_tile) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          st[4 * j + e] = ex2_approx(fmaf(st[4 * j + e], scale_log2, (e & 1) ? -lq[j].y : -lq[j].x));
    } else {
      // Masked tiles (sequence ends, mask edges): the visibility test without branches.
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = ex2_approx(fmaf(st[4 * j + e], scale_log2, (e & 1) ? -lq[j].y : -lq[j].x));
          const i64 i = m0 + 8 * j + 2 * t + (e & 1), jj = n0 + key_l + (e >> 1) * 8;
          const i64 pos = i + off;
          const bool ok = (i < sq.len) & (jj < sk.len) & ((wl < 0) | (jj >= pos - wl)) &
                          ((wr < 0) | (jj <= pos + wr));
          st[4 * j + e] = ok ? p : 0.f;
        }
    }
    unsigned pa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);

    wgmma_wait<0>();
    acc_fence(dp);
    // dSᵀ in place of dPᵀ.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 dl = lds_f2(rs + (B_BM + 8 * j + 2 * t) * 4);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[4 * j + e] = st[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
    }
    // The last read of this stage's rows: hand them back to warp 1 if it will rewrite them.
    if (it + B_STAGES < steps) named_arrive(ROWS_BAR + s, ROWS_BAR_THREADS);
    unsigned da[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) da[kk][r] = pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);

    // dV += Pᵀ·dO, dK += dSᵀ·Q (K = the 64 queries; B read MN-major).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv(dv_acc, pa[kk], smem_desc(dos + kk * 2048, B_BM * 128, 1024));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv(dk_acc, da[kk], smem_desc(qs + kk * 2048, B_BM * 128, 1024));
    wgmma_commit();

    // dSᵀ rows of this warpgroup into the swizzled tile: row r, 16-byte chunk j at (j ^ r%8).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = key_l + 8 * hh;
        sts_u32(ds + r * 128 + ((j ^ (r & 7)) << 4) + 4 * t, da[j / 2][(j & 1) * 2 + hh]);
      }
    fence_async_smem();
    named_sync(1, 256);

    // dQ_tile[:, c·D/2 ..] = dS·K: A = dSᵀ tile (M = queries contiguous), B = K (N = d contiguous).
    float dq[DQ_REGS];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < B_BN / 16; ++kk)
      wgmma_dq(dq, smem_desc(ds + kk * 2048, B_BM * 128, 1024),
               smem_desc(k_dq + kk * 2048, B_BN * 128, 1024), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(dq);
    acc_fence(dv_acc);
    acc_fence(dk_acc);
    // Every lane's reads of the stage (lds_f2 of its rows above) are ordered before lane 0's
    // release of it.
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const i64 row = m0 + warp * 16 + g + 8 * hh;
      if (row < sq.len) {
        float* dst = dq_acc + row_index(cu_q, b, h, hq, max_sq, lse_rows, sq, row) * D + c * DQ_N;
#pragma unroll
        for (int j = 0; j < DQ_N / 8; ++j)
          red_add2(dst + 8 * j + 2 * t, dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
      }
    }
    if (++mi == mtiles) {
      mi = 0;
      ++h;
    }
  }

  // dK = scale·Σ dSᵀ·Q, dV = Σ Pᵀ·dO, stored as column pairs.
  const i64 kbase = (cu_k ? 0 : (i64)b * ks_b) + (i64)hk * ks_h;
  const i64 vbase = (cu_k ? 0 : (i64)b * vs_b) + (i64)hk * vs_h;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const i64 key = n0 + key_l + 8 * hh;
    if (key < sk.len) {
      T* krow = dk + kbase + (sk.start + key) * ks_s;
      T* vrow = dv + vbase + (sk.start + key) * vs_s;
#pragma unroll
      for (int j = 0; j < O_REGS / 4; ++j) {
        *reinterpret_cast<unsigned*>(krow + 8 * j + 2 * t) =
            pack2<T>(dk_acc[4 * j + 2 * hh] * scale, dk_acc[4 * j + 2 * hh + 1] * scale);
        *reinterpret_cast<unsigned*>(vrow + 8 * j + 2 * t) =
            pack2<T>(dv_acc[4 * j + 2 * hh], dv_acc[4 * j + 2 * hh + 1]);
      }
    }
  }
}
#endif  // FE_BWD
