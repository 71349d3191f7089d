// attention/flash — the `flash` rung: FlashAttention-2-style forward and backward on tensor cores
// through mma.sync (sm_80+; runs on Hopper too, where the `hopper` rung is the faster one).
//
// Specialised by -DFE_ELEM (__half or __nv_bfloat16), -DFE_HEAD_DIM (32, 64, 96 or 128),
// -DFE_SOFTCAP, -DFE_FWD_MT (forward tile) and -DFE_BWD_WARPS/_BM/_QM (one-pass backward tile).
//
// Forward (`flash_fwd`): a block of 8 warps owns 128 query rows of one (sequence, head); each warp
// owns 16 rows and keeps its Q fragments, its 16×D output accumulator and the running row max and
// sum in registers. Key/value tiles of 64 rows stream through a 2-stage cp.async ring in shared
// memory; per tile a warp computes S = Q·Kᵀ (mma m16n8k16, fp32 accumulate), applies scale,
// soft-cap and the mask, rescales its output by exp(m_old − m_new) (online softmax), converts P
// to 16-bit straight from the accumulator registers (an m16n8 accumulator pair is exactly an
// m16n8k16 A-fragment half) and accumulates O += P·V with V fragments from ldmatrix.trans.
// S is never written anywhere: memory O(S·D) instead of the naive rung's O(S²), and K/V are read
// once per 128 queries instead of once per query.
//
// Backward, deterministic (`AttentionOptions::deterministic`; the default is the one-pass
// `flash_bwd_fused` further down), by construction, no atomics: two kernels after Δ:
// - `flash_bwd_dot`: Δ_i = Σ_d dO_i·O_i (fp32), one warp per row.
// - `flash_bwd_dkdv`: a block of 4 warps owns 64 keys of one (sequence, kv head), 16 per warp,
//   and loops over every query head of the group and every 32-query tile: it recomputes Sᵀ = K·Qᵀ
//   and Pᵀ = exp(Sᵀ − lse), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − Δ), and accumulates dV += Pᵀ·dO and
//   dK += dSᵀ·Q in registers (transposed products, so the accumulators of Pᵀ and dSᵀ are again
//   A fragments). GQA's sum over the group happens in registers, in a fixed order.
// - `flash_bwd_dq`: a block of 4 warps owns 64 query rows, 16 per warp, loops over 32-key tiles:
//   recomputes S, P, dP = dO·Vᵀ, dS and accumulates dQ += dS·K.
//   The price of determinism: QKᵀ and dO·Vᵀ are computed twice (7 GEMMs instead of 5).
//
// Edges: tiles are zero-filled past the end of a sequence (cp.async with src-size 0), masked
// scores are −inf, a row that sees no key has l = 0 and gets o = 0 and lse = −inf. Index math is
// 64-bit. Shared rows are padded by 16 bytes, which makes every ldmatrix bank-conflict-free.

#include "ferrite.cuh"
#include "async.cuh"
#include "mma.cuh"
#include "sfu.cuh"
using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM __nv_bfloat16
#endif
#ifndef FE_HEAD_DIM
#define FE_HEAD_DIM 128
#endif
typedef FE_ELEM T;
constexpr int D = FE_HEAD_DIM;
constexpr int LDS = D + 8;  // padded shared row (elements)
constexpr bool IS_BF16 = IsBf16<T>::value;
static_assert(D % 32 == 0 && D <= 128, "head dim 32, 64, 96 or 128");

// NVRTC has no <math.h> INFINITY.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// ---- small PTX wrappers -----------------------------------------------------------------------

// d += a·b for one m16n8k16 tile, fp32 accumulate (bf16 or f16 inputs, as T).
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  mma_m16n8k16<IS_BF16>(d, a, b0, b1);
}

// ---- problem geometry ---------------------------------------------------------------------------

// Element strides (batch, seq, head) of one tensor; the head dim is contiguous.
struct Strides {
  i64 b, s, h;
};

// Where one sequence of the batch lives: first row in the (packed or padded) seq dimension, its
// length, and the batch offset in elements for padded layouts.
struct Seq {
  i64 start, len;
};
__device__ __forceinline__ Seq seq_of(const int* cu, int b, int max_len) {
  if (cu == nullptr) return Seq{0, max_len};
  const int s0 = cu[b], s1 = cu[b + 1];
  return Seq{s0, s1 - s0};
}

// Visible key range [lo, hi) for the query rows [r0, r1) of a sequence with lengths (sq, sk):
// query i sits at position i + sk − sq (bottom-right alignment) and sees keys in
// [pos − wl, pos + wr] (−1 = unbounded).
__device__ __forceinline__ void key_range(i64 r0, i64 r1, i64 sq, i64 sk, i64 wl, i64 wr, i64& lo,
                                          i64& hi) {
  const i64 off = sk - sq;
  lo = wl >= 0 ? max((i64)0, r0 + off - wl) : 0;
  hi = wr >= 0 ? min(sk, r1 - 1 + off + wr + 1) : sk;
}
__device__ __forceinline__ bool visible(i64 i, i64 j, i64 off, i64 sk, i64 wl, i64 wr) {
  const i64 pos = i + off;
  return j < sk && (wl < 0 || j >= pos - wl) && (wr < 0 || j <= pos + wr);
}

// Copies rows [row0, row0 + R) of a [len, D] slab (row stride `ld` elements) into s[R][LDS],
// zero-filling rows at or past `len`. NT threads.
template <int R, int NT>
__device__ __forceinline__ void load_rows(T* s, const T* __restrict__ g, i64 ld, i64 row0, i64 len) {
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  static_assert((R * CPR) % NT == 0, "whole chunks per thread");
#pragma unroll
  for (int q = 0; q < R * CPR / NT; ++q) {
    const int e = threadIdx.x + q * NT;
    const int r = e / CPR, c = (e % CPR) * 8;
    const bool ok = row0 + r < len;
    cp_async16(s + r * LDS + c, ok ? g + (row0 + r) * ld + c : g, ok);
  }
}

// The scaled score in the log2 domain: s·scale·log2(e), or softcap·tanh(s·scale/softcap)·log2(e).
// Soft-capping compiled in (1) or out (0): the host picks the specialisation.
#ifndef FE_SOFTCAP
#define FE_SOFTCAP 0
#endif
struct ScoreMap {
  float scale_log2, cap_in, cap_out_log2;
  int capped;
  __device__ __forceinline__ float operator()(float s) const {
    return FE_SOFTCAP ? cap_out_log2 * tanh_approx(s * cap_in) : s * scale_log2;
  }
};

constexpr unsigned ROWB = LDS * sizeof(T);  // bytes per padded K/V/Q/dO row
constexpr int INT32_MIN_ = -0x7fffffff - 1, INT32_MAX_ = 0x7fffffff;


// Copies rows [row0, row0 + R) of a [len, D] slab (row stride `ld`, rows at or past len
// zero-filled) into a padded shared tile at shared address `s`; NT threads. When NT is a multiple
// of the 16-byte chunks per row, a thread's chunks sit in one column, NT/CPR rows apart: one
// 64-bit address per tile, then adds (`load_rows` multiplies per chunk).
template <int R, int NT>
__device__ __forceinline__ void copy_tile(unsigned s, const T* __restrict__ g, i64 ld, int row0,
                                          int len) {
  constexpr int CPR = D / 8, CH = R * CPR / NT;
  static_assert((R * CPR) % NT == 0, "whole chunks per thread");
  if constexpr (NT % CPR == 0) {
    constexpr int RSTEP = NT / CPR;
    const int r0 = threadIdx.x / CPR, c0 = (threadIdx.x % CPR) * 8;
    const unsigned s0 = s + (unsigned)(r0 * LDS + c0) * sizeof(T);
    const T* p = g + (i64)(row0 + r0) * ld + c0;
    const i64 pstep = (i64)RSTEP * ld;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const bool ok = row0 + r0 + i * RSTEP < len;
      cp_async16_s(s0 + i * RSTEP * ROWB, ok ? p : g, ok);
      p += pstep;
    }
  } else {
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const int e = threadIdx.x + i * NT;
      const int r = e / CPR, c = (e % CPR) * 8;
      const bool ok = row0 + r < len;
      cp_async16_s(s + (unsigned)(r * LDS + c) * sizeof(T), ok ? g + (i64)(row0 + r) * ld + c : g,
                   ok);
    }
  }
}

// ---- forward ------------------------------------------------------------------------------------

// 4 warps × 32 query rows (two m16 tiles per warp, FE_FWD_MT = 2): every K/V fragment a warp loads from shared
// memory feeds two MMAs, which halves the shared-memory traffic per FLOP compared with 16 rows
// per warp (at 16 rows the kernel was bound by ldmatrix bandwidth on the H100). Q fragments are
// re-read from shared memory per k-step instead of being held (registers go to the accumulators).
// FE_FWD_MT = 1 keeps the earlier shape (8 warps × 16 rows) for comparison. Keys come in tiles of
// 64 (FE_FWD_BN; FA2's shape): at head dim 128 the two accumulator sets, 64 scores per lane and
// the loop fit in 255 registers only with the block's geometry in shared memory and the loop in
// 32-bit values (32-key tiles: 0.93× FA2 at S16384 D128; 64-key tiles 1.08×; docs/attention.md).
#ifndef FE_FWD_MT
#define FE_FWD_MT 2
#endif
constexpr int F_MT = FE_FWD_MT;  // m16 tiles per warp
constexpr int F_BM = 128, F_WARPS = F_BM / (16 * F_MT), F_NT = F_WARPS * 32;
#ifndef FE_FWD_BN
#define FE_FWD_BN 64
#endif
constexpr int F_BN = FE_FWD_BN;
// Lazy rescaling's threshold (log2 domain): p ≤ 2^8 between rescales (FlashAttention-4's choice).
constexpr float F_LAZY = 8.f;

extern "C" __global__ void __launch_bounds__(F_NT, 1)
flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
          T* __restrict__ o, float* __restrict__ lse, const int* __restrict__ cu_q,
          const int* __restrict__ cu_k, int hq, int hkv, int max_sq, int max_sk, Strides qs,
          Strides ks, Strides vs, Strides os, i64 lse_rows, i64 wl, i64 wr, ScoreMap smap) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The host sizes shared memory from its copy of the tile shape (flash.rs fwd_tile): a
  // mismatch must fail loudly, not run past the allocation.
  if (dynamic_smem_bytes() < (F_BM + 4 * F_BN) * ROWB) __trap();
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + F_BM * LDS;      // [2][F_BN][LDS]
  T* sV = sK + 2 * F_BN * LDS;  // [2][F_BN][LDS]

  const int b = blockIdx.z, h = blockIdx.y;
  const int hk = h / (hq / hkv);
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  // Longest blocks first under a causal mask (the last query tiles see the most keys).
  const i64 m0 = (i64)(gridDim.x - 1 - blockIdx.x) * F_BM;
  if (m0 >= sq.len) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const T* qb = q + (cu_q ? 0 : (i64)b * qs.b) + sq.start * qs.s + (i64)h * qs.h;
  const T* kb = k + (cu_k ? 0 : (i64)b * ks.b) + sk.start * ks.s + (i64)hk * ks.h;
  const T* vb = v + (cu_k ? 0 : (i64)b * vs.b) + sk.start * vs.s + (i64)hk * vs.h;
  const i64 off = sk.len - sq.len;
  // What the loop's copies and the final store need of the block's geometry is kept in shared
  // memory, not in registers: at head dim 128 the two accumulator sets leave none to spare, and
  // a few shared loads per tile cost less than the spills (ptxas keeps derived values live).
  __shared__ struct {
    const T* kb;
    const T* vb;
    T* ob;
    i64 ks, vs, os, lse0;  // row strides; the lse index of row 0
    int sq_len, sk;        // sequence lengths
    int p0;                // position (bottom-right aligned) of the block's first query row
    int wl, wr;            // window (−1: unbounded)
    int full_lo, full_hi;  // the tiles with no per-element mask (see below)
  } blk;
  if (threadIdx.x == 0) {
    blk.kb = kb;
    blk.vb = vb;
    blk.ob = o + (cu_q ? 0 : (i64)b * os.b) + sq.start * os.s + (i64)h * os.h;
    blk.ks = ks.s;
    blk.vs = vs.s;
    blk.os = os.s;
    blk.lse0 = cu_q ? (i64)h * lse_rows + sq.start : ((i64)b * hq + h) * (i64)max_sq;
    blk.sq_len = (int)sq.len;
  }

  i64 lo, hi;
  key_range(m0, min(m0 + F_BM, sq.len), sq.len, sk.len, wl, wr, lo, hi);
  const i64 nb_lo = lo / F_BN, nb_hi = hi > lo ? (hi + F_BN - 1) / F_BN : nb_lo;

  // Shared addresses as 32-bit values: a fragment load is then one register plus a constant
  // offset folded into LDSM (the generic-pointer form cost a LEA per load).
  const unsigned aQ = smem_u32(sQ), aK = smem_u32(sK), aV = smem_u32(sV);
  constexpr unsigned KV_STAGE = F_BN * ROWB;  // bytes between the two K (or V) stages
  const int skn = (int)sk.len;
  copy_tile<F_BM, F_NT>(aQ, qb, qs.s, (int)m0, (int)sq.len);
  cp_async_commit();
  if (nb_lo < nb_hi) {
    copy_tile<F_BN, F_NT>(aK, kb, ks.s, (int)(nb_lo * F_BN), skn);
    copy_tile<F_BN, F_NT>(aV, vb, vs.s, (int)(nb_lo * F_BN), skn);
  }
  cp_async_commit();
  // This lane's ldmatrix rows and columns (bytes): Q rows lane & 15 of each m16 tile, column
  // half lane >> 4; K rows (lane & 7) + 8·(lane >> 4), column half (lane >> 3) & 1; V (transposed
  // load) rows (lane & 7) + 8·((lane >> 3) & 1), column half lane >> 4.
  const unsigned q_lane = aQ + ((warp * 16 * F_MT + (lane & 15)) * LDS + (lane >> 4) * 8) * sizeof(T);
  const unsigned k_lane = ((lane & 7) + ((lane >> 4) << 3)) * ROWB + ((lane >> 3) & 1) * 16;
  const unsigned v_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;

  float acc[F_MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  float m_run[F_MT][2], l_run[F_MT][2];
#pragma unroll
  for (int mt = 0; mt < F_MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;
  const i64 row_w = m0 + warp * 16 * F_MT + g;  // rows row_w + 16·mt + 8·r
  // Without soft-cap the scale is folded into the exponent: p = 2^(s·c − max·c), one FFMA.
  const float mul = FE_SOFTCAP ? 1.f : smap.scale_log2;
  // The mask in 32-bit arithmetic (positions < 2³¹; windows wider than that are unbounded),
  // its block-wide values in blk: fewer live registers, which this kernel is short of at head
  // dim 128 (a lane's row position is rebuilt from threadIdx in the masked path).
  const int nhi = (int)nb_hi;
  int st = 0;  // the ring stage of the tile being computed
  if (threadIdx.x == 0) {
    const i64 p_lo = m0 + off, p_hi = min(m0 + F_BM, sq.len) - 1 + off;
    blk.wl = (wl < 0 || wl > 0x7fffffff) ? -1 : (int)wl;
    blk.wr = (wr < 0 || wr > 0x7fffffff) ? -1 : (int)wr;
    blk.sk = (int)sk.len;
    blk.p0 = (int)(m0 + off);
    // Tiles starting in [full_lo, full_hi] need no per-element mask: every key of the tile
    // exists and is inside every row's window.
    blk.full_lo = (int)max((i64)INT32_MIN_, wl < 0 ? (i64)INT32_MIN_ : p_hi - wl);
    blk.full_hi = (int)min(sk.len - F_BN, wr < 0 ? sk.len : p_lo + wr - (F_BN - 1));
  }
  __syncthreads();  // blk is written

  for (int nb = (int)nb_lo; nb < nhi; ++nb, st ^= 1) {
    if (nb + 1 < nhi) {
      copy_tile<F_BN, F_NT>(aK + (st ^ 1) * KV_STAGE, blk.kb, blk.ks, (nb + 1) * F_BN, blk.sk);
      copy_tile<F_BN, F_NT>(aV + (st ^ 1) * KV_STAGE, blk.vb, blk.vs, (nb + 1) * F_BN, blk.sk);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's K and V (and Q, the first time) have landed
    __syncthreads();
    const unsigned cK = aK + st * KV_STAGE + k_lane;
    const unsigned cV = aV + st * KV_STAGE + v_lane;

    // S = Q·Kᵀ for 32 rows × 64 keys per warp.
    float s[F_MT][F_BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
      for (int i = 0; i < F_BN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned qf[F_MT][4];
#pragma unroll
      for (int mt = 0; mt < F_MT; ++mt)
        ldsm_x4_s(qf[mt], q_lane + mt * 16 * ROWB + kk * 32);
#pragma unroll
      for (int np = 0; np < F_BN / 16; ++np) {
        unsigned r[4];
        ldsm_x4_s(r, cK + np * 16 * ROWB + kk * 32);
#pragma unroll
        for (int mt = 0; mt < F_MT; ++mt) {
          mma(s[mt][2 * np], qf[mt], r[0], r[1]);
          mma(s[mt][2 * np + 1], qf[mt], r[2], r[3]);
        }
      }
    }

    // Soft-cap and mask. A tile needs the per-element mask only where it crosses the end of the
    // keys or a window edge for some row of the block.
    const int n0 = nb * F_BN;
    const bool full = n0 >= blk.full_lo && n0 <= blk.full_hi;
    if (FE_SOFTCAP) {
#pragma unroll
      for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < F_BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = smap.cap_out_log2 * tanh_approx(s[mt][nt][e] * smap.cap_in);
    }
    // The tile's test is uniform: taken once, not per element (inside the unrolled loop ptxas
    // kept a branch per element, taken on every full tile too); the masked path is branch-free.
    if (!full) {
#pragma unroll
      for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          // Visible keys of this row, relative to the tile: [jlo, jhi].
          const int lane_row = (int)(threadIdx.x >> 5) * 16 * F_MT + (int)((threadIdx.x & 31) >> 2);
          const int pos = blk.p0 + lane_row + 16 * mt + e2 * 8 - n0;
          const int wl32 = blk.wl, wr32 = blk.wr;
          const int jlo = wl32 >= 0 ? pos - wl32 : -0x7fffffff;
          const int jhi = min(blk.sk - 1 - n0, wr32 >= 0 ? pos + wr32 : 0x7fffffff);
#pragma unroll
          for (int nt = 0; nt < F_BN / 8; ++nt)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
              const int j = nt * 8 + 2 * t + e1;
              float& x = s[mt][nt][2 * e2 + e1];
              x = (j < jlo) | (j > jhi) ? -INFINITY : x;
            }
        }
    }

    // Online softmax, per m16 tile rows g (e = 0, 1) and g + 8 (e = 2, 3); a row is shared by a
    // quad of lanes. Lazy rescaling: the exponent's reference m_run moves (and O and l are
    // rescaled by 2^(m_old − m_new)) only when some row of the warp's tile sees a max more than
    // F_LAZY above its m_run; otherwise the stale m_run stays, the tile's p are ≤ 2^F_LAZY (fine
    // in 16 bits and in the f32 sums) and the 128-FMUL rescale of O is skipped. Past the first
    // tiles the running max rarely grows that much, so most tiles skip it. o = O/l and
    // lse = m_run + log2 l hold for any reference, so the results do not depend on which tiles
    // rescaled (the rounding of p to 16 bits does, within its precision).
    float mx[F_MT][2];
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < F_BN / 8; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx[mt][r] = m * mul;  // this tile's row max, log2 domain
        grow |= mx[mt][r] > m_run[mt][r] + F_LAZY;
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(mx[mt][r], m_run[mt][r]);
          // A row with nothing visible yet keeps −inf (and base 0: its p stay 0).
          const float alpha = ex2_approx(m_run[mt][r] - (m_new == -INFINITY ? 0.f : m_new));
          m_run[mt][r] = m_new;
          l_run[mt][r] *= alpha;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            acc[mt][dt][2 * r] *= alpha;
            acc[mt][dt][2 * r + 1] *= alpha;
          }
        }
    }
    // P = 2^(s·c − m) packed to 16 bits as soon as it is computed, straight into P·V's A
    // fragments (half the registers of the f32 scores they replace; no moves): fragment kk of an
    // m16 tile holds rows g, g + 8 of keys 16kk + 2t, +1 (regs 0, 1) and 16kk + 8 + 2t, +1 (2, 3).
    unsigned pa[F_MT][F_BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float base = m_run[mt][r] == -INFINITY ? 0.f : m_run[mt][r];
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < F_BN / 8; ++nt) {
          const float p0 = ex2_approx(fmaf(s[mt][nt][2 * r], mul, -base));
          const float p1 = ex2_approx(fmaf(s[mt][nt][2 * r + 1], mul, -base));
          sum += p0 + p1;
          pa[mt][nt / 2][(nt & 1) * 2 + r] = pack2<T>(p0, p1);
        }
        l_run[mt][r] += sum;  // per-lane partial; the quad is summed at the end
      }

    // O += P·V: P's accumulator pairs are the A fragments; V through ldmatrix.trans, each
    // fragment feeding both m16 tiles.
#pragma unroll
    for (int kk = 0; kk < F_BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned r[4];
        ldsm_x4_ts(r, cV + kk * 16 * ROWB + dp * 32);
#pragma unroll
        for (int mt = 0; mt < F_MT; ++mt) {
          mma(acc[mt][2 * dp], pa[mt][kk], r[0], r[1]);
          mma(acc[mt][2 * dp + 1], pa[mt][kk], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  // Normalise and store: rows row_w + 16·mt + 8·r; columns 8·dt + 2t, +1 (one 32-bit store each).
#pragma unroll
  for (int mt = 0; mt < F_MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const i64 row = row_w + 16 * mt + r * 8;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (row < blk.sq_len) {
        T* orow = blk.ob + row * blk.os;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
          *reinterpret_cast<unsigned*>(orow + dt * 8 + 2 * t) =
              pack2<T>(acc[mt][dt][2 * r] * inv, acc[mt][dt][2 * r + 1] * inv);
        if (t == 0) {
          const float val = l > 0.f ? (m_run[mt][r] + log2f(l)) * LN2 : -INFINITY;
          lse[blk.lse0 + row] = val;
        }
      }
    }
}

// ---- backward -----------------------------------------------------------------------------------

// Δ_i = Σ_d dO_i·O_i for every (row, head); one warp per row, stored like lse.
extern "C" __global__ void flash_bwd_dot(const T* __restrict__ dout, const T* __restrict__ o,
                                         float* __restrict__ delta, const int* __restrict__ cu_q,
                                         int batch, int hq, int max_sq, Strides os, i64 lse_rows) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + warp;  // over (b, h, i) of the padded grid
  const i64 total = (i64)batch * hq * max_sq;
  if (gw >= total) return;
  const int b = (int)(gw / ((i64)hq * max_sq));
  const int h = (int)((gw / max_sq) % hq);
  const i64 i = gw % max_sq;
  const Seq sq = seq_of(cu_q, b, max_sq);
  if (i >= sq.len) return;
  const i64 base = (cu_q ? 0 : (i64)b * os.b) + (sq.start + i) * os.s + (i64)h * os.h;
  float acc = 0.f;
  for (int d = lane * 2; d < D; d += 64) {
    const float2 x = unpack2<T>(*reinterpret_cast<const unsigned*>(dout + base + d));
    const float2 y = unpack2<T>(*reinterpret_cast<const unsigned*>(o + base + d));
    acc += x.x * y.x + x.y * y.y;
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) {
    const i64 idx = cu_q ? (i64)h * lse_rows + sq.start + i : ((i64)b * hq + h) * (i64)max_sq + i;
    delta[idx] = acc;
  }
}

constexpr int B_WARPS = 4, B_NT = B_WARPS * 32;
constexpr int KV_BN = 64;  // keys per dK/dV block (16 per warp)
constexpr int KV_BM = 32;  // queries per inner tile

// Stores a 16×D accumulator of a warp (rows r0 + g, r0 + g + 8) scaled by `mul` into g[row·ld + d],
// rows at or past `len` skipped.
__device__ __forceinline__ void store_acc(T* __restrict__ gp, i64 ld, i64 r0, i64 len,
                                          const float (&acc)[D / 8][4], float mul) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 row = r0 + g + r * 8;
    if (row >= len) continue;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<unsigned*>(gp + row * ld + dt * 8 + 2 * t) =
          pack2<T>(acc[dt][2 * r] * mul, acc[dt][2 * r + 1] * mul);
  }
}

// The scores of one (query i, key j) after scale/soft-cap in the log2 domain, and the factor the
// soft-cap's derivative puts on dS (1 − tanh²; 1 without soft-cap).
__device__ __forceinline__ float capped_grad(const ScoreMap& m, float x_log2) {
  if (!m.capped) return 1.f;
  const float th = x_log2 / m.cap_out_log2;
  return 1.f - th * th;
}

extern "C" __global__ void __launch_bounds__(B_NT, 1)
flash_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ dout, const float* __restrict__ lse,
               const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
               const int* __restrict__ cu_q, const int* __restrict__ cu_k, int hq, int hkv,
               int max_sq, int max_sk, Strides qs, Strides ks, Strides vs, Strides os,
               Strides dks, Strides dvs, i64 lse_rows, i64 wl, i64 wr, ScoreMap smap,
               float scale) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // [KV_BN][LDS]
  T* sV = sK + KV_BN * LDS;                // [KV_BN][LDS]
  T* sQ = sV + KV_BN * LDS;                // [2][KV_BM][LDS]
  T* sdO = sQ + 2 * KV_BM * LDS;           // [2][KV_BM][LDS]
  float* sL = reinterpret_cast<float*>(sdO + 2 * KV_BM * LDS);  // [2][KV_BM] lse·log2(e)
  float* sD = sL + 2 * KV_BM;                                     // [2][KV_BM] Δ

  const int b = blockIdx.z, hk = blockIdx.y;
  const int group = hq / hkv;
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  const i64 n0 = (i64)blockIdx.x * KV_BN;
  if (n0 >= sk.len) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 off = sk.len - sq.len;

  const T* kb = k + (cu_k ? 0 : (i64)b * ks.b) + sk.start * ks.s + (i64)hk * ks.h;
  const T* vb = v + (cu_k ? 0 : (i64)b * vs.b) + sk.start * vs.s + (i64)hk * vs.h;
  load_rows<KV_BN, B_NT>(sK, kb, ks.s, n0, sk.len);
  load_rows<KV_BN, B_NT>(sV, vb, vs.s, n0, sk.len);
  cp_async_commit();

  // Query rows that can see any of the keys [n0, n0 + KV_BN): i + off − wl ≤ j ≤ i + off + wr.
  const i64 n1 = min(n0 + KV_BN, sk.len);
  i64 q_lo = wr >= 0 ? max((i64)0, n0 - off - wr) : 0;
  i64 q_hi = wl >= 0 ? min(sq.len, n1 - 1 - off + wl + 1) : sq.len;
  const i64 mb_lo = q_lo / KV_BM, mb_hi = q_hi > q_lo ? (q_hi + KV_BM - 1) / KV_BM : mb_lo;
  const i64 tiles = mb_hi - mb_lo, steps = tiles * group;

  float dK[D / 8][4], dV[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dK[i][e] = dV[i][e] = 0.f;

  // Loads step `st` (query tile × head of the group) into ring slot st & 1.
  auto load_step = [&](i64 st) {
    const int hh = hk * group + (int)(st / tiles);
    const i64 m0 = (mb_lo + st % tiles) * KV_BM;
    const int slot = (int)(st & 1);
    const T* qb = q + (cu_q ? 0 : (i64)b * qs.b) + sq.start * qs.s + (i64)hh * qs.h;
    const T* db = dout + (cu_q ? 0 : (i64)b * os.b) + sq.start * os.s + (i64)hh * os.h;
    load_rows<KV_BM, B_NT>(sQ + slot * KV_BM * LDS, qb, qs.s, m0, sq.len);
    load_rows<KV_BM, B_NT>(sdO + slot * KV_BM * LDS, db, os.s, m0, sq.len);
    if (threadIdx.x < KV_BM) {
      const i64 i = m0 + threadIdx.x;
      float l = INFINITY, dl = 0.f;  // rows past the end: P = exp(−inf) = 0
      if (i < sq.len) {
        const i64 idx = cu_q ? (i64)hh * lse_rows + sq.start + i : ((i64)b * hq + hh) * (i64)max_sq + i;
        l = lse[idx] * LOG2E;
        dl = delta[idx];
        if (l == -INFINITY) l = INFINITY;  // a row that saw nothing has P = 0 everywhere
      }
      sL[slot * KV_BM + threadIdx.x] = l;
      sD[slot * KV_BM + threadIdx.x] = dl;
    }
  };
  if (steps > 0) load_step(0);
  cp_async_commit();

  const i64 key_w = n0 + warp * 16;  // this warp's keys: key_w + g and key_w + g + 8
  for (i64 st = 0; st < steps; ++st) {
    const int slot = (int)(st & 1);
    if (st + 1 < steps) load_step(st + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cQ = sQ + slot * KV_BM * LDS;
    const T* cdO = sdO + slot * KV_BM * LDS;
    const float* cL = sL + slot * KV_BM;
    const float* cD = sD + slot * KV_BM;
    const i64 m0 = (mb_lo + st % tiles) * KV_BM;

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: 16 keys × 32 queries per warp.
    float s[KV_BM / 8][4], dp[KV_BM / 8][4];
#pragma unroll
    for (int i = 0; i < KV_BM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned ak[4], av[4];
      ldsm_x4(ak, sK + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
      ldsm_x4(av, sV + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < KV_BM / 16; ++np) {
        unsigned r[4];
        const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        ldsm_x4(r, cQ + row * LDS + col);
        mma(s[2 * np], ak, r[0], r[1]);
        mma(s[2 * np + 1], ak, r[2], r[3]);
        ldsm_x4(r, cdO + row * LDS + col);
        mma(dp[2 * np], av, r[0], r[1]);
        mma(dp[2 * np + 1], av, r[2], r[3]);
      }
    }
    // Pᵀ and dSᵀ in place. Element (key key_w + g + 8·(e>>1), query m0 + 8·nt + 2t + (e&1)).
#pragma unroll
    for (int nt = 0; nt < KV_BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1);
        const i64 i = m0 + qi, j = key_w + g + (e >> 1) * 8;
        const float x = smap(s[nt][e]);
        float p = ex2_approx(x - cL[qi]);
        if (!visible(i, j, off, sk.len, wl, wr) || i >= sq.len) p = 0.f;
        s[nt][e] = p;
        dp[nt][e] = p * (dp[nt][e] - cD[qi]) * capped_grad(smap, x);
      }
    // dV += Pᵀ·dO and dK += dSᵀ·Q: the k dim is the query tile; dO and Q through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < KV_BM / 16; ++kk) {
      const unsigned ap[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const unsigned ad[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]), pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                              pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                              pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
      for (int dq = 0; dq < D / 16; ++dq) {
        unsigned r[4];
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = dq * 16 + (lane >> 4) * 8;
        ldsm_x4_t(r, cdO + row * LDS + col);
        mma(dV[2 * dq], ap, r[0], r[1]);
        mma(dV[2 * dq + 1], ap, r[2], r[3]);
        ldsm_x4_t(r, cQ + row * LDS + col);
        mma(dK[2 * dq], ad, r[0], r[1]);
        mma(dK[2 * dq + 1], ad, r[2], r[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  T* dkb = dk + (cu_k ? 0 : (i64)b * dks.b) + sk.start * dks.s + (i64)hk * dks.h;
  T* dvb = dv + (cu_k ? 0 : (i64)b * dvs.b) + sk.start * dvs.s + (i64)hk * dvs.h;
  store_acc(dkb, dks.s, key_w, sk.len, dK, scale);
  store_acc(dvb, dvs.s, key_w, sk.len, dV, 1.f);
}

constexpr int Q_BM = 64;  // queries per dQ block (16 per warp)
constexpr int Q_BN = 32;  // keys per inner tile

extern "C" __global__ void __launch_bounds__(B_NT, 1)
flash_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             const T* __restrict__ dout, const float* __restrict__ lse,
             const float* __restrict__ delta, T* __restrict__ dq, const int* __restrict__ cu_q,
             const int* __restrict__ cu_k, int hq, int hkv, int max_sq, int max_sk, Strides qs,
             Strides ks, Strides vs, Strides os, Strides dqs, i64 lse_rows, i64 wl, i64 wr,
             ScoreMap smap, float scale) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [Q_BM][LDS]
  T* sdO = sQ + Q_BM * LDS;                // [Q_BM][LDS]
  T* sK = sdO + Q_BM * LDS;                // [2][Q_BN][LDS]
  T* sV = sK + 2 * Q_BN * LDS;             // [2][Q_BN][LDS]

  const int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  const i64 m0 = (i64)(gridDim.x - 1 - blockIdx.x) * Q_BM;
  if (m0 >= sq.len) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 off = sk.len - sq.len;

  const T* qb = q + (cu_q ? 0 : (i64)b * qs.b) + sq.start * qs.s + (i64)h * qs.h;
  const T* db = dout + (cu_q ? 0 : (i64)b * os.b) + sq.start * os.s + (i64)h * os.h;
  const T* kb = k + (cu_k ? 0 : (i64)b * ks.b) + sk.start * ks.s + (i64)hk * ks.h;
  const T* vb = v + (cu_k ? 0 : (i64)b * vs.b) + sk.start * vs.s + (i64)hk * vs.h;

  i64 lo, hi;
  key_range(m0, min(m0 + Q_BM, sq.len), sq.len, sk.len, wl, wr, lo, hi);
  const i64 nb_lo = lo / Q_BN, nb_hi = hi > lo ? (hi + Q_BN - 1) / Q_BN : nb_lo;

  load_rows<Q_BM, B_NT>(sQ, qb, qs.s, m0, sq.len);
  load_rows<Q_BM, B_NT>(sdO, db, os.s, m0, sq.len);
  cp_async_commit();
  if (nb_lo < nb_hi) {
    load_rows<Q_BN, B_NT>(sK, kb, ks.s, nb_lo * Q_BN, sk.len);
    load_rows<Q_BN, B_NT>(sV, vb, vs.s, nb_lo * Q_BN, sk.len);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  const i64 row_g = m0 + warp * 16 + g;
  float lrow[2], drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 i = row_g + 8 * r;
    lrow[r] = INFINITY;
    drow[r] = 0.f;
    if (i < sq.len) {
      const i64 idx = cu_q ? (i64)h * lse_rows + sq.start + i : ((i64)b * hq + h) * (i64)max_sq + i;
      const float l = lse[idx];
      lrow[r] = l == -INFINITY ? INFINITY : l * LOG2E;
      drow[r] = delta[idx];
    }
  }

  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (i64 nb = nb_lo; nb < nb_hi; ++nb) {
    const int st = (int)((nb - nb_lo) & 1);
    if (nb + 1 < nb_hi) {
      load_rows<Q_BN, B_NT>(sK + (st ^ 1) * Q_BN * LDS, kb, ks.s, (nb + 1) * Q_BN, sk.len);
      load_rows<Q_BN, B_NT>(sV + (st ^ 1) * Q_BN * LDS, vb, vs.s, (nb + 1) * Q_BN, sk.len);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cK = sK + st * Q_BN * LDS;
    const T* cV = sV + st * Q_BN * LDS;

    float s[Q_BN / 8][4], dp[Q_BN / 8][4];
#pragma unroll
    for (int i = 0; i < Q_BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned aq[4], ad[4];
      ldsm_x4(aq, sQ + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
      ldsm_x4(ad, sdO + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < Q_BN / 16; ++np) {
        unsigned r[4];
        const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        ldsm_x4(r, cK + row * LDS + col);
        mma(s[2 * np], aq, r[0], r[1]);
        mma(s[2 * np + 1], aq, r[2], r[3]);
        ldsm_x4(r, cV + row * LDS + col);
        mma(dp[2 * np], ad, r[0], r[1]);
        mma(dp[2 * np + 1], ad, r[2], r[3]);
      }
    }
    const i64 n0 = nb * Q_BN;
#pragma unroll
    for (int nt = 0; nt < Q_BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const i64 i = row_g + 8 * r, j = n0 + nt * 8 + 2 * t + (e & 1);
        const float x = smap(s[nt][e]);
        float p = ex2_approx(x - lrow[r]);
        if (!visible(i, j, off, sk.len, wl, wr)) p = 0.f;
        dp[nt][e] = p * (dp[nt][e] - drow[r]) * capped_grad(smap, x);
      }
    // dQ += dS·K: K through ldmatrix.trans (k dim = keys).
#pragma unroll
    for (int kk = 0; kk < Q_BN / 16; ++kk) {
      const unsigned a[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]), pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                             pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                             pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        unsigned r[4];
        ldsm_x4_t(r, cK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dd * 16 +
                         (lane >> 4) * 8);
        mma(acc[2 * dd], a, r[0], r[1]);
        mma(acc[2 * dd + 1], a, r[2], r[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  T* dqb = dq + (cu_q ? 0 : (i64)b * dqs.b) + sq.start * dqs.s + (i64)h * dqs.h;
  store_acc(dqb, dqs.s, m0 + warp * 16, sq.len, acc, scale);
}

// ---- non-deterministic backward: dQ through f32 atomics (the default) ---------------------------
//
// `flash_bwd_fused` is `flash_bwd_dkdv` plus dQ: for each query tile it also computes the tile's
// share of dQ, dQ_tile = dS·K over the block's keys, and adds it into an f32 accumulator
// [rows like lse][D] in global memory with red.global.add (vectorised .v2 on sm_90). dS goes
// through shared memory (dSᵀ, 16-bit, the same rounding the dK product uses) because each warp
// holds dSᵀ for its own 16 keys only, while a dQ row sums over all the block's keys.
// This drops the second recomputation of S, P and dP that `flash_bwd_dq` does: 5 GEMMs of work
// instead of 7. The order of the atomic additions varies from run to run, so dQ's low bits do;
// `flash_bwd_dq_convert` then writes dq = scale·acc in the output dtype and strides.
//
// The loop is lean because, at 16 keys per warp, the kernel issues far more non-tensor
// instructions than mma (the first version: 2.0k SASS instructions per step for 160 HMMA, bound
// by instruction issue at 2 warps per scheduler): no 64-bit division in the loop (head and tile
// counters advance by one), per-thread copy offsets and ldmatrix addresses computed once (32-bit
// shared addresses, per-step changes are one add), the mask applied only to warp tiles that
// cross a sequence end or a mask edge (a tile inside the visible region skips it; causal at
// S = 4096 has ~3 % of such tiles), soft-capping's derivative chosen at compile time.
//
// Geometry (the host picks it per head dim and defines all three):
// - FE_BWD_WARPS warps × 16 keys per block (the dK/dV accumulators of 16 keys × D are what a
//   warp can hold at D = 128);
// - FE_BWD_BM queries per step (the width of the warp's Sᵀ/dPᵀ tile: 64 halves the K/V fragment
//   reloads per mma of Sᵀ and dPᵀ and the barriers per FLOP, and fits at D ≤ 64);
// - FE_BWD_QM m16 tiles per warp in dQ_tile = dS·K; the warps tile dQ_tile's [BM × D] as a grid
//   of (BM / 16·QM) × (WARPS / that) warps, each (16·QM) rows × (16·QN) columns.
#ifndef FE_BWD_WARPS
#define FE_BWD_WARPS 4
#endif
#ifndef FE_BWD_BM
#define FE_BWD_BM 32
#endif
#ifndef FE_BWD_QM
#define FE_BWD_QM 1
#endif
constexpr int U_WARPS = FE_BWD_WARPS, U_NT = U_WARPS * 32;
constexpr int U_BN = 16 * U_WARPS;  // keys per block
constexpr int U_BM = FE_BWD_BM;     // queries per step
constexpr int U_LDT = U_BM + 8;     // padded row of sdSᵀ (elements): conflict-free at BM 32 and 64
constexpr int U_QM = FE_BWD_QM;
constexpr int U_WGM = U_BM / (16 * U_QM);  // warp grid over dQ_tile: rows ...
constexpr int U_WGN = U_WARPS / U_WGM;     // ... and columns
constexpr int U_QN = D / 16 / U_WGN;       // 16-column groups per warp
static_assert(U_BM % 32 == 0 && U_BM % (16 * U_QM) == 0 && U_WARPS % U_WGM == 0 &&
                  (D / 16) % U_WGN == 0 && U_QN >= 1,
              "FE_BWD_* geometry does not tile dQ_tile");
constexpr unsigned ROWT = U_LDT * sizeof(T);   // bytes per padded dSᵀ row

extern "C" __global__ void __launch_bounds__(U_NT, 1)
flash_bwd_fused(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const float* __restrict__ lse,
                const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                float* __restrict__ dq_acc, const int* __restrict__ cu_q,
                const int* __restrict__ cu_k, int hq, int hkv, int max_sq, int max_sk, Strides qs,
                Strides ks, Strides vs, Strides os, Strides dks, Strides dvs, i64 lse_rows, i64 wl,
                i64 wr, ScoreMap smap, float scale) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Byte offsets in shared memory: K, V [U_BN][LDS]; Q, dO [2][U_BM][LDS]; dSᵀ [U_BN][U_LDT];
  // lse·log2(e) and Δ [2][U_BM] floats.
  constexpr unsigned O_K = 0, O_V = O_K + U_BN * ROWB, O_Q = O_V + U_BN * ROWB;
  constexpr unsigned O_DO = O_Q + 2 * U_BM * ROWB, O_DS = O_DO + 2 * U_BM * ROWB;
  constexpr unsigned O_L = O_DS + U_BN * ROWT, O_D = O_L + 2 * U_BM * 4;
  constexpr unsigned SLOT = U_BM * ROWB;  // bytes between the two Q (or dO) slots
  const unsigned sbase = smem_u32(smem_raw);
  float* sL = reinterpret_cast<float*>(smem_raw + O_L);
  float* sD = reinterpret_cast<float*>(smem_raw + O_D);

  const int b = blockIdx.z, hk = blockIdx.y;
  const int group = hq / hkv;
  const Seq sq = seq_of(cu_q, b, max_sq), sk = seq_of(cu_k, b, max_sk);
  // Lengths and positions fit in 32 bits (max_sq, max_sk are ints).
  const int sqn = (int)sq.len, skn = (int)sk.len;
  const int n0 = blockIdx.x * U_BN;
  if (n0 >= skn) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 off = sk.len - sq.len;

  const T* kb = k + (cu_k ? 0 : (i64)b * ks.b) + sk.start * ks.s + (i64)hk * ks.h;
  const T* vb = v + (cu_k ? 0 : (i64)b * vs.b) + sk.start * vs.s + (i64)hk * vs.h;
  copy_tile<U_BN, U_NT>(sbase + O_K, kb, ks.s, n0, skn);
  copy_tile<U_BN, U_NT>(sbase + O_V, vb, vs.s, n0, skn);
  cp_async_commit();

  // Query rows that can see any of the keys [n0, n0 + U_BN): i + off − wl ≤ j ≤ i + off + wr.
  const i64 n1 = min((i64)n0 + U_BN, sk.len);
  const i64 q_lo = wr >= 0 ? max((i64)0, (i64)n0 - off - wr) : 0;
  const i64 q_hi = wl >= 0 ? min(sq.len, n1 - 1 - off + wl + 1) : sq.len;
  const int mb_lo = (int)(q_lo / U_BM);
  const int tiles = q_hi > q_lo ? (int)((q_hi + U_BM - 1) / U_BM) - mb_lo : 0;
  const int steps = tiles * group;
  // The key blocks of one head run at the same time; each starts at a different query tile so
  // that their atomic additions go to different dQ rows instead of queueing on the same ones.
  const int rot = tiles > 0 ? (int)(blockIdx.x % (unsigned)tiles) : 0;
  // A step is (query head of the group, rotated tile index); advancing wraps the tile index and
  // moves to the next head when it comes back to `rot`.
  struct Step {
    int hh, rt;
  };
  auto advance = [&](Step s) {
    s.rt = s.rt + 1 == tiles ? 0 : s.rt + 1;
    if (s.rt == rot) ++s.hh;
    return s;
  };

  float dK[D / 8][4], dV[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dK[i][e] = dV[i][e] = 0.f;

  // Row 0 of head hh in lse/Δ (and, times D, in the dQ accumulator).
  auto lse_row0 = [&](int hh) {
    return cu_q ? (i64)hh * lse_rows + sq.start : ((i64)b * hq + hh) * (i64)max_sq;
  };
  // Loads step `s` into ring slot `slot`.
  auto load_step = [&](Step s, int slot) {
    const int m0 = (mb_lo + s.rt) * U_BM;
    // (The bases are recomputed per step rather than held: this kernel is short of registers.)
    const T* qb = q + (cu_q ? 0 : (i64)b * qs.b) + sq.start * qs.s + (i64)s.hh * qs.h;
    const T* db = dout + (cu_q ? 0 : (i64)b * os.b) + sq.start * os.s + (i64)s.hh * os.h;
    copy_tile<U_BM, U_NT>(sbase + O_Q + slot * SLOT, qb, qs.s, m0, sqn);
    copy_tile<U_BM, U_NT>(sbase + O_DO + slot * SLOT, db, os.s, m0, sqn);
    if (threadIdx.x < U_BM) {
      const int i = m0 + threadIdx.x;
      float l = INFINITY, dl = 0.f;  // rows past the end: P = exp(−inf) = 0
      if (i < sqn) {
        const i64 idx = lse_row0(s.hh) + i;
        l = lse[idx] * LOG2E;
        dl = delta[idx];
        if (l == -INFINITY) l = INFINITY;  // a row that saw nothing has P = 0 everywhere
      }
      sL[slot * U_BM + threadIdx.x] = l;
      sD[slot * U_BM + threadIdx.x] = dl;
    }
  };
  Step cur{hk * group, rot};
  if (steps > 0) load_step(cur, 0);
  cp_async_commit();

  const int kw = warp * 16;  // this warp's keys in the block: kw + g and kw + g + 8
  const int key_w = n0 + kw;
  // This warp's part of dQ_tile: rows qr0 .. qr0 + 16·QM, columns c0 .. c0 + 16·QN.
  const int qr0 = (warp / U_WGN) * 16 * U_QM, c0 = (warp % U_WGN) * 16 * U_QN;
  // Per-lane ldmatrix addresses (slot 0 for Q and dO); the unrolled loops add constants.
  // A fragments of K and V (rows = keys), B fragments of Q and dO (rows = queries), B fragments
  // through .trans of dO and Q (rows = queries, the k dim) and of K (rows = keys), A fragments
  // through .trans of dSᵀ (rows = keys, the k dim).
  // (Absolute shared addresses: the other tensor of a pair is a constant offset away, and only
  // three registers stay live across the loop for all of them.)
  const unsigned a_k = sbase + O_K + (unsigned)((kw + (lane & 15)) * LDS + (lane >> 4) * 8) * sizeof(T);
  const unsigned b_q = sbase + O_Q + (unsigned)(((lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8) * sizeof(T);
  const unsigned bt_q = sbase + O_Q + (unsigned)(((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8) * sizeof(T);
  const float mul = FE_SOFTCAP ? 1.f : smap.scale_log2;
  // The mask as bounds on j − i (key index minus query index, which 32 bits hold for lengths
  // below 2³¹): visible iff off − wl ≤ j − i ≤ off + wr; the bounds clamped to 32 bits, which
  // is exact for every j − i.
  const auto clamp32 = [](i64 x) { return (int)max((i64)INT32_MIN_, min((i64)INT32_MAX_, x)); };
  const int dlo = wl >= 0 ? clamp32(off - wl) : INT32_MIN_;
  const int dhi = wr >= 0 ? clamp32(off + wr) : INT32_MAX_;

  // Barriers per step: one after the step's tiles land (every warp then reads them), one after
  // dSᵀ is complete (before dQ reads it). The next step's prefetch into the other slot is issued
  // after the second, when no warp still reads that slot; the next step's dSᵀ writes come after
  // the next first barrier, when every warp has finished this step's dQ.
  for (int st = 0; st < steps; ++st) {
    const int slot = st & 1;
    if (st + 1 < steps) load_step(advance(cur), slot ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned bq = b_q + slot * SLOT, btq = bt_q + slot * SLOT;
    const float* cL = sL + slot * U_BM;
    const float* cD = sD + slot * U_BM;
    const int m0 = (mb_lo + cur.rt) * U_BM;

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: 16 keys × U_BM queries per warp.
    float s[U_BM / 8][4], dp[U_BM / 8][4];
#pragma unroll
    for (int i = 0; i < U_BM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned ak[4], av[4];
      ldsm_x4_s(ak, a_k + kk * 32);
      ldsm_x4_s(av, a_k + (O_V - O_K) + kk * 32);
#pragma unroll
      for (int np = 0; np < U_BM / 16; ++np) {
        unsigned r[4];
        ldsm_x4_s(r, bq + np * 16 * ROWB + kk * 32);
        mma(s[2 * np], ak, r[0], r[1]);
        mma(s[2 * np + 1], ak, r[2], r[3]);
        ldsm_x4_s(r, bq + (O_DO - O_Q) + np * 16 * ROWB + kk * 32);
        mma(dp[2 * np], av, r[0], r[1]);
        mma(dp[2 * np + 1], av, r[2], r[3]);
      }
    }
    // Pᵀ and dSᵀ in place. Element (key key_w + g + 8·(e>>1), query m0 + 8·nt + 2t + (e&1)).
#pragma unroll
    for (int nt = 0; nt < U_BM / 8; ++nt) {
      const float2 l2 = *reinterpret_cast<const float2*>(cL + nt * 8 + 2 * t);
      const float2 d2 = *reinterpret_cast<const float2*>(cD + nt * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lq = (e & 1) ? l2.y : l2.x, dq = (e & 1) ? d2.y : d2.x;
        float p, grad = 1.f;
        if (FE_SOFTCAP) {
          const float th = tanh_approx(s[nt][e] * smap.cap_in);
          p = ex2_approx(smap.cap_out_log2 * th - lq);
          grad = 1.f - th * th;
        } else {
          p = ex2_approx(fmaf(s[nt][e], mul, -lq));
        }
        s[nt][e] = p;
        dp[nt][e] = p * (dp[nt][e] - dq) * grad;
      }
    }
    // The mask, only where this warp's 16 keys × U_BM queries are not all visible: past either
    // sequence end, or crossing a window edge for some row.
    const bool full = m0 + U_BM <= sqn && key_w + 16 <= skn && key_w - (m0 + U_BM - 1) >= dlo &&
                      key_w + 15 - m0 <= dhi;
    if (!full) {
#pragma unroll
      for (int nt = 0; nt < U_BM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = m0 + nt * 8 + 2 * t + (e & 1), j = key_w + g + (e >> 1) * 8;
          const int d = j - i;
          if (i >= sqn || j >= skn || d < dlo || d > dhi) s[nt][e] = dp[nt][e] = 0.f;
        }
    }
    // 16-bit Pᵀ and dSᵀ, as the A fragments of the next products: element pairs (rows g, g + 8)
    // of accumulator nt; dSᵀ also into shared memory for dQ (row = key, 32-bit word = 2 queries).
    unsigned pp[U_BM / 8][2], dd[U_BM / 8][2];
    const unsigned st_ds = sbase + O_DS + (unsigned)((kw + g) * U_LDT + 2 * t) * sizeof(T);
#pragma unroll
    for (int nt = 0; nt < U_BM / 8; ++nt) {
      pp[nt][0] = pack2<T>(s[nt][0], s[nt][1]);
      pp[nt][1] = pack2<T>(s[nt][2], s[nt][3]);
      dd[nt][0] = pack2<T>(dp[nt][0], dp[nt][1]);
      dd[nt][1] = pack2<T>(dp[nt][2], dp[nt][3]);
      sts_u32(st_ds + nt * 16, dd[nt][0]);
      sts_u32(st_ds + 8 * ROWT + nt * 16, dd[nt][1]);
    }
    // dV += Pᵀ·dO and dK += dSᵀ·Q: the k dim is the query tile; dO and Q through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < U_BM / 16; ++kk) {
      const unsigned ap[4] = {pp[2 * kk][0], pp[2 * kk][1], pp[2 * kk + 1][0], pp[2 * kk + 1][1]};
      const unsigned ad[4] = {dd[2 * kk][0], dd[2 * kk][1], dd[2 * kk + 1][0], dd[2 * kk + 1][1]};
#pragma unroll
      for (int dc = 0; dc < D / 16; ++dc) {
        unsigned r[4];
        ldsm_x4_ts(r, btq + (O_DO - O_Q) + kk * 16 * ROWB + dc * 32);
        mma(dV[2 * dc], ap, r[0], r[1]);
        mma(dV[2 * dc + 1], ap, r[2], r[3]);
        ldsm_x4_ts(r, btq + kk * 16 * ROWB + dc * 32);
        mma(dK[2 * dc], ad, r[0], r[1]);
        mma(dK[2 * dc + 1], ad, r[2], r[3]);
      }
    }
    __syncthreads();  // dSᵀ complete; every warp is done with this slot's Q and dO

    // dQ_tile = dS·K over the block's keys (k dim): dS from dSᵀ and K from [key][d], both
    // through ldmatrix.trans.
    const unsigned at_ds = sbase + O_DS + (unsigned)(((lane & 7) + ((lane >> 4) << 3)) * U_LDT + qr0 +
                                                     ((lane >> 3) & 1) * 8) * sizeof(T);
    const unsigned bt_k = bt_q - O_Q + O_K + c0 * sizeof(T);
    float qa[U_QM][2 * U_QN][4];
#pragma unroll
    for (int mi = 0; mi < U_QM; ++mi)
#pragma unroll
      for (int nj = 0; nj < 2 * U_QN; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[mi][nj][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < U_BN / 16; ++kk) {
      unsigned a[U_QM][4];
#pragma unroll
      for (int mi = 0; mi < U_QM; ++mi) ldsm_x4_ts(a[mi], at_ds + kk * 16 * ROWT + mi * 32);
#pragma unroll
      for (int nj = 0; nj < U_QN; ++nj) {
        unsigned r[4];
        ldsm_x4_ts(r, bt_k + kk * 16 * ROWB + nj * 32);
#pragma unroll
        for (int mi = 0; mi < U_QM; ++mi) {
          mma(qa[mi][2 * nj], a[mi], r[0], r[1]);
          mma(qa[mi][2 * nj + 1], a[mi], r[2], r[3]);
        }
      }
    }
    float* acc_h = dq_acc + lse_row0(cur.hh) * D + c0 + 2 * t;
#pragma unroll
    for (int mi = 0; mi < U_QM; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + qr0 + mi * 16 + g + 8 * r;
        if (i >= sqn) continue;
        float* row = acc_h + (i64)i * D;
#pragma unroll
        for (int nj = 0; nj < 2 * U_QN; ++nj) red_add2(row + nj * 8, qa[mi][nj][2 * r], qa[mi][nj][2 * r + 1]);
      }
    cur = advance(cur);
  }
  cp_async_wait<0>();

  T* dkb = dk + (cu_k ? 0 : (i64)b * dks.b) + sk.start * dks.s + (i64)hk * dks.h;
  T* dvb = dv + (cu_k ? 0 : (i64)b * dvs.b) + sk.start * dvs.s + (i64)hk * dvs.h;
  store_acc(dkb, dks.s, key_w, sk.len, dK, scale);
  store_acc(dvb, dvs.s, key_w, sk.len, dV, 1.f);
}

// dq = scale·acc in dq's dtype and strides; acc holds rows like lse ([B, Hq, Sq] padded,
// [Hq, total_q] varlen), D floats each. A thread per 8 elements: two 16-byte loads, one store.
extern "C" __global__ void flash_bwd_dq_convert(const float* __restrict__ acc, T* __restrict__ dq,
                                                const int* __restrict__ cu_q, int batch, int hq,
                                                int max_sq, Strides dqs, i64 lse_rows,
                                                float scale) {
  constexpr int CPR = D / 8;
  const i64 rows = cu_q ? (i64)hq * lse_rows : (i64)batch * hq * max_sq;
  const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= rows * CPR) return;
  const i64 idx = e / CPR;
  const int c = (int)(e % CPR) * 8;
  i64 at;
  if (cu_q) {
    // Packed row r of head h: cu_q is not needed, the packed row is the sequence row.
    const i64 h = idx / lse_rows, r = idx % lse_rows;
    at = r * dqs.s + h * dqs.h;
  } else {
    const i64 bb = idx / ((i64)hq * max_sq), h = (idx / max_sq) % hq, i = idx % max_sq;
    at = bb * dqs.b + i * dqs.s + h * dqs.h;
  }
  const float4 x = *reinterpret_cast<const float4*>(acc + idx * D + c);
  const float4 y = *reinterpret_cast<const float4*>(acc + idx * D + c + 4);
  uint4 out;
  out.x = pack2<T>(x.x * scale, x.y * scale);
  out.y = pack2<T>(x.z * scale, x.w * scale);
  out.z = pack2<T>(y.x * scale, y.y * scale);
  out.w = pack2<T>(y.z * scale, y.w * scale);
  *reinterpret_cast<uint4*>(dq + at + c) = out;
}
