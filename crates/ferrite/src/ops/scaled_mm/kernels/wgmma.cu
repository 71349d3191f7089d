// scaled_mm/wgmma — the Hopper rungs: FP8 × FP8 on the tensor cores at twice the bf16 rate
// (sm_90a only), fed by the tensor memory accelerator, with the scales and the bias applied to
// the fp32 accumulators on the way out.
//
// What changes vs `naive` (a thread per output, FP8 decoded in software, no reuse):
// - Copies: one producer thread keeps a ring of FE_STAGES stages full by TMA — A 128 rows × 128
//   bytes of k and B FE_BN rows × 128 bytes (128 FP8 values of k per row: one 128-byte swizzle
//   row, the layout wgmma reads without bank conflicts); zero fill past every edge, so any m, n,
//   k runs without predicates in the loop. Completion is counted in bytes on an mbarrier.
// - Math: `wgmma.mma_async.m64nBNk32.f32.e4m3.e4m3` (or e5m2 for either operand): one
//   instruction per warpgroup multiplies a 64×32 slice of A by a 32×BN slice of B straight from
//   shared memory into fp32 accumulators. FP8 wgmma takes K-major operands only (no transpose
//   bit, as for tf32): A is [m][k] and B is [n][k], k contiguous — what torch._scaled_mm takes
//   (its b = weight.t()) and a linear layer's weight is.
// - Warp specialisation and a persistent grid as in matmul's `wgmma`: warpgroup 0 produces
//   (`setmaxnreg.dec` 40), warpgroups 1 and 2 consume 64 rows each (`setmaxnreg.inc` 232); one
//   block per SM walks the C tiles in groups of 8 row tiles (tiles in flight share A and B in L2).
// - Epilogue: D = acc · sa(row) · sb(col) + bias(col), rounded once to the output type. 16-bit D
//   (-DFE_TMA_STORE=1, when D is 16-byte aligned with 16-byte rows): each warp stages its 16 rows
//   in shared memory with stmatrix and the TMA unit stores them, clipped at the edges, while the
//   warp starts its next tile; otherwise (f32 D, unaligned D) pairs of columns stored from the
//   registers where aligned, every store predicated at the edges.
//
// Two builds:
// - FE_PROMOTE=0 (`wgmma_fast`, 128×256 tiles): the tensor core's accumulator holds the whole
//   k sum. Hopper's FP8 MMA adds its products into that accumulator with fewer mantissa bits
//   than fp32 (about 14 kept, reported by DeepSeek-V3), so the error grows with k: what
//   torch._scaled_mm's `use_fast_accum=True` (cuBLASLt's FAST_ACCUM) does.
// - FE_PROMOTE=1 (`wgmma`, 128×192 or 128×128 tiles): each stage's 128-deep partial product is
//   computed into a fresh accumulator (scale-d = 0 on its first wgmma) and then added into a
//   second set of fp32 registers — the periodic promotion of CUTLASS's and DeepGEMM's FP8
//   kernels, and what cuBLASLt does without FAST_ACCUM (torch's default). Two sets of 96 fit a
//   consumer thread's 232 registers beside the loop's state (two of 128 would not). The
//   promotion needs the stage's wgmmas finished (wait_group 0) before the adds: the warpgroup's
//   tensor work pauses for the FADDs of a stage, which the other consumer warpgroup's wgmmas
//   fill. 192 columns read less shared memory per multiply-add than 128 and measured 1.1× faster
//   per tile on large problems; the host takes 128 where that leaves fewer tiles' waves short.
#include "hopper.cuh"
#include "mma.cuh"

using namespace ferrite;

#ifndef FE_OUT
#define FE_OUT float
#endif
#ifndef FE_A_E5M2
#define FE_A_E5M2 0
#endif
#ifndef FE_B_E5M2
#define FE_B_E5M2 0
#endif
#ifndef FE_BN
#define FE_BN 256
#endif
#ifndef FE_PROMOTE
#define FE_PROMOTE 0
#endif
#ifndef FE_STAGES
#define FE_STAGES 4
#endif
// -DFE_TMA_STORE=1 (16-bit D): each consumer warp writes its 16 rows of the tile into a staging
// area with stmatrix and hands each 16×64 box to the TMA unit (the consumers' epilogue).
#ifndef FE_TMA_STORE
#define FE_TMA_STORE 0
#endif
// The operand slots after the accumulators (BN/2 of them) in the wgmma asm.
#if FE_BN == 256
#define FE_DESC_A_SLOT 128
#define FE_DESC_B_SLOT 129
#define FE_SCALE_SLOT 130
#elif FE_BN == 192
#define FE_DESC_A_SLOT 96
#define FE_DESC_B_SLOT 97
#define FE_SCALE_SLOT 98
#else
#define FE_DESC_A_SLOT 64
#define FE_DESC_B_SLOT 65
#define FE_SCALE_SLOT 66
#endif
#if FE_A_E5M2
#define FE_A_TY "e5m2"
#else
#define FE_A_TY "e4m3"
#endif
#if FE_B_E5M2
#define FE_B_TY "e5m2"
#else
#define FE_B_TY "e4m3"
#endif
typedef FE_OUT TO;

constexpr int BM = 128, BN = FE_BN, BK = 128, STAGES = FE_STAGES, NTHREADS = 384;
// Row tiles per group of the tile order.
constexpr int GROUP_M = 8;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
// fp32 accumulators per consumer thread: a warpgroup's 64 × BN over 128 threads.
constexpr int NACC = BN / 2;
static_assert(BN == 128 || BN == 192 || BN == 256, "128-, 192- or 256-column tiles");
static_assert(!FE_PROMOTE || BN <= 192, "promotion keeps two accumulator sets: ≤ 192 columns");
// The staging area: per consumer warp, its 16 rows × BN columns as BN/64 boxes of 16×64 16-bit
// values (2 KiB each, 128-byte swizzled: the layout the TMA store reads).
constexpr int SBOX = 16 * 128;
constexpr int STAGING_BYTES = FE_TMA_STORE ? 8 * (BN / 64) * SBOX : 0;
static_assert(!FE_TMA_STORE || sizeof(TO) == 2, "TMA-store epilogue: 16-bit D");
static_assert(STAGES * STAGE_BYTES + STAGING_BYTES + 1024 + 16 * STAGES <= 227 * 1024,
              "ring and staging fit one block");

// d (64×BN fp32, wgmma accumulator layout) = [scale_d ? d : 0] + A(64×32, desc da)·B(32×BN,
// desc db)ᵀ, both K-major.
#if FE_BN == 256
#define FE_ACC(d) FE_ACC128(d)
#define FE_ACC_SLOTS FE_ACC_SLOTS128
#elif FE_BN == 192
#define FE_ACC(d) FE_ACC96(d)
#define FE_ACC_SLOTS FE_ACC_SLOTS96
#else
#define FE_ACC(d) FE_ACC64(d)
#define FE_ACC_SLOTS FE_ACC_SLOTS64
#endif
// Operands after the accumulators: a-desc %NACC, b-desc %NACC+1, scale-d %NACC+2.
#define FE_STR2(x) #x
#define FE_STR(x) FE_STR2(x)
__device__ __forceinline__ void wgmma_fp8(float (&d)[NACC], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" FE_STR(FE_SCALE_SLOT) ", 0;\n"
      "wgmma.mma_async.sync.aligned.m64n" FE_STR(FE_BN) "k32.f32." FE_A_TY "." FE_B_TY " {"
      FE_ACC_SLOTS "}, %" FE_STR(FE_DESC_A_SLOT) ", %" FE_STR(FE_DESC_B_SLOT) ", p, 1, 1;\n}\n"
      : FE_ACC(d)
      : "l"(da), "l"(db), "r"(scale_d));
}

// Tile t of the grouped order: GROUP_M row tiles × every column tile per group.
__device__ __forceinline__ void tile_of(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per_group = GROUP_M * tiles_n;
  const int first = t / per_group * GROUP_M;
  const int rows = min(tiles_m - first, GROUP_M);
  const int r = t % per_group;
  tm = first + r % rows;
  tn = r / rows;
}

__device__ __forceinline__ void store_pair(TO* p, float a, float b, bool pair) {
  if (pair) {
    if constexpr (sizeof(TO) == 4) {
      *reinterpret_cast<float2*>(p) = make_float2(a, b);
    } else {
      TO v[2] = {from_float<TO>(a), from_float<TO>(b)};
      *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(v);
    }
  } else {
    p[0] = from_float<TO>(a);
    p[1] = from_float<TO>(b);
  }
}

// The column scales and bias of one 64-column box [cb, cb + 64) of a warp's slice, read once per
// warp: lane l loads columns cb + 2l and cb + 2l + 1 (coalesced), and the pair a thread applies in
// column group jl (columns cb + 8·jl + 2·(lane % 4) + {0, 1}) is shuffled from lane
// 4·jl + lane % 4 (`box_pair`). Loading each pair where it is used put two dependent global loads
// on every output pair's path, and row-wise scales ran 5–15% slower than tensor-wise ones.
// Columns past n read as 0. Every lane of the warp must call both (shuffles).
struct BoxCols {
  float2 s, b;
};
__device__ __forceinline__ BoxCols box_cols(const float* __restrict__ scale_b, bool sb_col,
                                            float sb_all, const TO* __restrict__ bias, int cb,
                                            int n, int lane) {
  const int c = cb + 2 * lane;
  BoxCols r;
  r.s = sb_col ? make_float2(c < n ? scale_b[c] : 0.f, c + 1 < n ? scale_b[c + 1] : 0.f)
               : make_float2(sb_all, sb_all);
  r.b = bias ? make_float2(c < n ? to_float(bias[c]) : 0.f, c + 1 < n ? to_float(bias[c + 1]) : 0.f)
             : make_float2(0.f, 0.f);
  return r;
}
__device__ __forceinline__ float2 box_pair(float2 v, bool varies, int jl, int lane) {
  if (!varies) return v;
  const int src = 4 * jl + lane % 4;
  return make_float2(__shfl_sync(0xffffffffu, v.x, src), __shfl_sync(0xffffffffu, v.y, src));
}

// D[m][n] (rows ldd apart) = sa(i)·sb(j)·Σ_p A[i][p]·B[j][p] + bias[j]; sa(i) = scale_a[sa_row ?
// i : 0], sb(j) = scale_b[sb_col ? j : 0]; bias may be null. The host guarantees k > 0, m, n <
// 2^31 − 256, 16-byte aligned bases and row pitches of A and B (TMA), and the dynamic shared
// memory of the ring (checked below: a smaller one would overrun).
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    scaled_mm_wgmma(TO* __restrict__ D, const float* __restrict__ scale_a,
                    const float* __restrict__ scale_b, const TO* __restrict__ bias, int m, int n,
                    int k, i64 ldd, int sa_row, int sb_col,
                    const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
                    const __grid_constant__ TmaDesc tma_d, int store_tma,
                    float* __restrict__ part, int splits) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + 1023) & ~1023u;  // 128B swizzle atoms are 1024-byte aligned
  const unsigned staging = base + STAGES * STAGE_BYTES;  // FE_TMA_STORE: D boxes, per warp
  const unsigned full0 = staging + STAGING_BYTES;        // full[s] at full0 + 8s
  const unsigned empty0 = full0 + STAGES * 8;          // empty[s] at empty0 + 8s
  if (dynamic_smem_bytes() < (empty0 + STAGES * 8) - raw) __trap();

  // Split-K (splits > 1, few tiles): the walk is over (split, tile) pairs; split z takes k
  // tiles [z·per, z·per + per) and writes its raw fp32 sums to part[z] ([m][n]), which
  // scaled_mm_splitk_reduce adds up in split order (deterministic) and scales. The host never
  // makes an empty split.
  const int tiles_m = (int)ceil_div(m, BM), tiles_n = (int)ceil_div(n, BN);
  const int tiles = tiles_m * tiles_n, total = tiles * splits;
  const int ktiles_all = (int)ceil_div(k, BK), per = (int)ceil_div(ktiles_all, splits);
  // Tile t of the walk: its row and column tile, first k tile and k tile count.
  auto locate = [&](int t, int& tm, int& tn, int& kt0, int& nk) {
    tile_of(t % tiles, tiles_m, tiles_n, tm, tn);
    kt0 = t / tiles * per;
    nk = min(per, ktiles_all - kt0);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
    regs_dec<40>();
    if (threadIdx.x == 0) {
      prefetch_tensormap(&tma_a);
      prefetch_tensormap(&tma_b);
      int s = 0;
      unsigned ph = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int tm, tn, kt0, ktiles;
        locate(t, tm, tn, kt0, ktiles);
        for (int kt = kt0; kt < kt0 + ktiles; ++kt) {
          mbar_wait(empty0 + 8 * s, ph ^ 1);
          const unsigned bar = full0 + 8 * s;
          mbar_expect_tx(bar, STAGE_BYTES);
          const unsigned sa = base + s * STAGE_BYTES;
          tma_load(sa, &tma_a, bar, kt * BK, tm * BM, 0);
          tma_load(sa + A_BYTES, &tma_b, bar, kt * BK, tn * BN, 0);
          if (++s == STAGES) {
            s = 0;
            ph ^= 1;
          }
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c owns rows 64c..64c+63 of the tile ----
    regs_inc<232>();
    const int c = wg - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const bool pair_ok = ((u64)D % (2 * sizeof(TO)) == 0) && (ldd % 2 == 0);
    float d[NACC];
#if FE_PROMOTE
    float acc[NACC];
#endif
    int s = 0;
    unsigned ph = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int tm, tn, kt0, ktiles;
      locate(t, tm, tn, kt0, ktiles);
      (void)kt0;
#pragma unroll
      for (int i = 0; i < NACC; ++i) d[i] = 0.f;
#if FE_PROMOTE
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
#endif
      acc_fence(d);
      int prev = -1;
      for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(full0 + 8 * s, ph);
        const unsigned sa = base + s * STAGE_BYTES, sb = sa + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 32; ++kk) {
          // The kk-th 32-byte slice of every 128-byte row; 8-row groups 1024 bytes apart.
          const u64 da = smem_desc(sa + c * 64 * 128 + kk * 32, 16, 1024);
          const u64 db = smem_desc(sb + kk * 32, 16, 1024);
          wgmma_fp8(d, da, db, FE_PROMOTE ? kk > 0 : 1);
        }
        wgmma_commit();
#if FE_PROMOTE
        // This stage's partial sum, in full fp32 into acc; the stage is free once read.
        wgmma_wait<0>();
        acc_fence(d);
        if (lane == 0) mbar_arrive(empty0 + 8 * s);
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] += d[i];
#else
        wgmma_wait<1>();
        if (prev >= 0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
        prev = s;
#endif
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
#if FE_PROMOTE
      const float(&out)[NACC] = acc;
      (void)prev;
#else
      wgmma_wait<0>();
      acc_fence(d);
      if (prev >= 0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
      const float(&out)[NACC] = d;
#endif

      // Thread holds rows r, r + 8 and column pairs 8j + 2(lane % 4) of its warp's 16 rows:
      // out[4j + 2i + e] is row r + 8i, column 8j + 2(lane % 4) + e.
      const int r0 = tm * BM + c * 64 + warp * 16 + lane / 4;
      const int c0 = tn * BN + 2 * (lane % 4);
      const float sb_all = scale_b[0];
      if (splits > 1) {
        // This split's raw sums into its fp32 partial (pairs where n is even).
        float* w = part + (i64)(t / tiles) * m * n;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int row = r0 + 8 * i;
          if (row >= m) continue;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const int col = c0 + 8 * j;
            if (col >= n) break;
            float* q = w + (i64)row * n + col;
            if (col + 1 < n && n % 2 == 0) {
              *reinterpret_cast<float2*>(q) = make_float2(out[4 * j + 2 * i], out[4 * j + 2 * i + 1]);
            } else {
              q[0] = out[4 * j + 2 * i];
              if (col + 1 < n) q[1] = out[4 * j + 2 * i + 1];
            }
          }
        }
        continue;
      }
      const float sa[2] = {r0 < m ? scale_a[sa_row ? r0 : 0] : 0.f,
                           r0 + 8 < m ? scale_a[sa_row ? r0 + 8 : 0] : 0.f};
#if FE_TMA_STORE
      if (store_tma) {
        // The warp's 16 × BN slice through its staging boxes: scales and bias applied, rounded,
        // packed in pairs; stmatrix.x4 writes 4 8×8 matrices (column groups j, j + 1 × row halves)
        // into the 128-byte-swizzled box (16-byte chunk c of row r at r·128 + 16·(c ^ r % 8)),
        // then lane 0 issues the box's TMA store, which clips everything outside D. The warp goes
        // on to its next tile while the stores drain; the boxes are rewritten only after lane 0
        // has seen them read out (a whole mainloop later).
        const unsigned stg = staging + (c * 4 + warp) * (BN / 64) * SBOX;
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
        const unsigned lr = lane & 7, mat = lane >> 3;
        const unsigned lane_row = ((mat & 1) * 8 + lr) * 128;
#pragma unroll
        for (int q = 0; q < BN / 64; ++q) {
          const unsigned buf = stg + q * SBOX;
          const BoxCols bx = box_cols(scale_b, sb_col, sb_all, bias, tn * BN + 64 * q, n, lane);
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            unsigned v[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // column group jl = 2p + h: v[2h + row half]
              const int jl = 2 * p + h, jj = 8 * q + jl;
              const float2 sb = box_pair(bx.s, sb_col, jl, lane);
              const float2 bb = box_pair(bx.b, bias != nullptr, jl, lane);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                float v0 = out[4 * jj + 2 * i] * sa[i] * sb.x, v1 = out[4 * jj + 2 * i + 1] * sa[i] * sb.y;
                if (bias) {
                  v0 += bb.x;
                  v1 += bb.y;
                }
                v[2 * h + i] = pack2<TO>(v0, v1);
              }
            }
            const unsigned chunk = 2 * p + (mat >> 1);
            stmatrix_x4(buf + lane_row + ((chunk ^ lr) << 4), v[0], v[1], v[2], v[3]);
          }
          fence_async_smem();
          __syncwarp();
          if (lane == 0) tma_store(&tma_d, buf, tn * BN + 64 * q, r0 - lane / 4, 0);
        }
        if (lane == 0) bulk_commit();
        continue;
      }
#endif
#pragma unroll
      for (int q = 0; q < BN / 64; ++q) {
        if (tn * BN + 64 * q >= n) break;  // the same for the whole warp
        const BoxCols bx = box_cols(scale_b, sb_col, sb_all, bias, tn * BN + 64 * q, n, lane);
#pragma unroll
        for (int jl = 0; jl < 8; ++jl) {
          const int j = 8 * q + jl, col = c0 + 8 * j;
          const float2 sb = box_pair(bx.s, sb_col, jl, lane);
          const float2 bb = box_pair(bx.b, bias != nullptr, jl, lane);
          if (col >= n) continue;
          const bool two = col + 1 < n;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int row = r0 + 8 * i;
            if (row >= m) continue;
            float v0 = out[4 * j + 2 * i] * sa[i] * sb.x, v1 = out[4 * j + 2 * i + 1] * sa[i] * sb.y;
            if (bias) {
              v0 += bb.x;
              v1 += bb.y;
            }
            TO* drow = D + (i64)row * ldd;
            if (two)
              store_pair(drow + col, v0, v1, pair_ok);
            else
              drow[col] = from_float<TO>(v0);
          }
        }
      }
    }
#if FE_TMA_STORE
    // Shared memory stays allocated until the last stores have read it.
    if (lane == 0) bulk_wait<0>();
#endif
  }
}

// Split-K's second pass: D = (Σ_z part[z]) · sa(i) · sb(j) + bias[j], the splits added in order
// (the same bits on every run), rounded once to TO.
extern "C" __global__ void __launch_bounds__(256)
    scaled_mm_splitk_reduce(TO* __restrict__ D, const float* __restrict__ part,
                            const float* __restrict__ scale_a, const float* __restrict__ scale_b,
                            const TO* __restrict__ bias, int m, int n, i64 ldd, int sa_row,
                            int sb_col, int splits) {
  const i64 mn = (i64)m * n;
  for (i64 e = (i64)blockIdx.x * 256 + threadIdx.x; e < mn; e += (i64)gridDim.x * 256) {
    const int i = (int)(e / n), j = (int)(e % n);
    float acc = 0.f;
    for (int z = 0; z < splits; ++z) acc += part[z * mn + e];
    float v = acc * scale_a[sa_row ? i : 0] * scale_b[sb_col ? j : 0];
    if (bias) v += to_float(bias[j]);
    D[i * ldd + j] = from_float<TO>(v);
  }
}
