// matmul/wgmma — step 10 of the CUDA ladder: Hopper warpgroup MMA fed by the tensor memory
// accelerator (sm_90a only; bf16 and f16 in, or f32 in as tf32; fp32 accumulate).
//
// What changes vs `mma_pipelined` (mma.sync m16n8k16 + ldmatrix + 4-stage cp.async, 8 warps that
// all both copy and compute):
// - Copies: one thread issues `cp.async.bulk.tensor.3d` (TMA) per operand box; the copy engine
//   computes the addresses, zero-fills everything outside the matrix (so any m, n, k works with
//   no predicates in the loop) and writes the tile 128-byte swizzled, the layout wgmma reads
//   without bank conflicts. Completion is counted in bytes on an mbarrier (`expect_tx`).
// - Math: `wgmma.mma_async.m64n256k16` — one instruction per warpgroup (4 warps) multiplies a
//   64×16 slice of A by a 16×256 slice of B straight out of shared memory (no ldmatrix, no
//   fragment registers), asynchronously; the only registers are the 128 fp32 accumulators per
//   thread. It runs at Hopper's full tensor rate, which mma.sync cannot reach (≈ 2× per SM).
// - Warp specialisation: block = 3 warpgroups (384 threads). Warpgroup 0 is the producer: it
//   gives registers back (`setmaxnreg.dec` 40) and one of its threads keeps a ring of FE_STAGES
//   (4; 3 in the plain TMA-store build, see SBUF) stages of A 128×64 + B 64×256 (48 KiB each)
//   full. Warpgroups 1 and 2 are consumers
//   (`setmaxnreg.inc` 232): each owns 64 rows × 256 columns of the 128×256 C tile, waits on the
//   stage's `full` barrier, issues 4 wgmmas (k = 64), commits, keeps one wgmma group in flight
//   (`wgmma.wait_group 1`) and then releases the previous stage on its `empty` barrier.
// - Persistent grid: one block per SM walks the C tiles (index += gridDim.x) in a grouped order
//   (8 row tiles × all column tiles per group) so that the tiles in flight at once share A rows
//   and B columns in L2. The producer runs ahead into the next tile while the consumers write
//   the previous one (alpha/beta epilogue straight from the accumulators, predicated at edges,
//   beta == 0 never reads C).
// - Clusters (-DFE_CLUSTER=2, the default the host launches): two blocks on vertically adjacent
//   tiles share every B tile; each loads half of it with `.multicast::cluster` into both blocks'
//   rings, so B reads from L2 are halved. A stage is then free only when the consumers of both
//   blocks released it: each consumer warp arrives on the `empty` barrier of every block of the
//   cluster (`mapa` + remote arrive), and the `full` barrier of each block counts the bytes of
//   its own A plus both halves of B.
// Layouts (specialised by -DFE_A_TRANS / -DFE_B_TRANS): an operand whose contiguous dimension is k
// is loaded as one box and read K-major; one whose contiguous dimension is m or n (A transposed,
// B not) is loaded as 64-wide boxes and read MN-major (the wgmma transpose bit): all four
// layouts NN/NT/TN/TT. Batches are the third tensor-map dimension (broadcast: extent 1).
// TMA needs 16-byte aligned bases and leading dims / batch strides that are multiples of 16
// bytes; the host declines anything else (mma_pipelined runs it).
// tf32 (-DFE_WGMMA_TF32=1, f32 storage): `wgmma...m64n256k8.f32.tf32.tf32`. A stage holds the
// same bytes (one 128-byte swizzle row of k = 32 floats: A 128×32 + B 256×32 = 48 KiB), so the
// tensor maps (FLOAT32, boxes of 32 × rows), the 1024-byte swizzle atoms, the descriptors (kk·32
// bytes into each row, SBO 1024) and the barrier byte counts are the 16-bit kernel's; a stage is
// 4 wgmmas of k8 instead of k16, which take as long (tf32 runs at half the bf16 rate). tf32 wgmma
// has no transpose bit, so both operands must be K-major: the host compiles only A row-major /
// B transposed and runs `matmul_wgmma_pack` (end of file) first on any operand that is m/n-
// contiguous or not 16-byte aligned (a K-major tf32-rounded copy in scratch). Operands read in
// place are not rounded: the tensor core uses the top 19 bits of each f32 (truncation).
// Prediction (H100, 4096³ bf16): ≈ 2.5–3.5× mma_pipelined, 0.7–0.9× cuBLAS. Measured there
// (first version, direct stores): 3.2× mma_pipelined, 0.89–1.0× cuBLAS at 4096³ and 0.81–0.96×
// at 8192³ (medians vary between runs; minimums match cuBLAS). With -DFE_EPI the consumers'
// stores apply the fused epilogue of common.cuh (bias per column, pre-activation Z, activation,
// residual), its seven parameters after group_m, element by element in the store loop; with
// -DFE_EPI_PAIRS=1 (`persistent_pairs`) interior tiles go through wg_epilogue_tma instead (bias
// pairs loaded into registers before the tile's mainloop, Z and Y staged and TMA-stored like the
// plain C). Same configuration as the plain kernel either way (tile, stages, cluster, grid, 168
// registers, no spills).
// The TMA-store epilogue (-DFE_TMA_STORE=1, 16-bit C): direct stores from registers take 64
// 4-byte stores per thread per tile, each warp instruction touching 8 rows (8 half-filled
// sectors), while the tensor cores wait. Instead each warp writes its 16 × 256 slice into a
// staging area with stmatrix (4 instructions per 16 × 64 box), one lane hands each box to the
// TMA unit, and the warp starts the next tile while the stores drain (the plain build stages the
// whole slice at once, beside a 3-stage ring: see SBUF). Measured on the H100 in the same
// alternating rounds: 4096³ bf16/f16 0.86–0.88× → 0.98–0.99× cuBLAS, 8192³ 0.92–0.95 →
// 0.96–1.04× (bench/results/2026-11-25-h100-wgmma-tma-store/wgmma-tma-store-vs-direct; `c2g8d`
// names the same launch with direct stores). Not done: last-wave balancing, other tile shapes.
// The activation-backward build (-DFE_EPI_DACT, `matmul_wgmma_dact`): 3 stages, a
// whole-tile staging area, no cluster; the producer warpgroup's warps 1–3 run its epilogue (see
// dact_helper_tile).

// TmaDesc, smem_u32, mbarriers, smem_desc, wgmma fences.
#include "hopper.cuh"
#include "mma.cuh"

#ifndef FE_A_TRANS
#define FE_A_TRANS 0
#endif
#ifndef FE_B_TRANS
#define FE_B_TRANS 0
#endif
#ifndef FE_STAGES
#define FE_STAGES 4
#endif
// Blocks per cluster along m (1 or 2): with 2, the pair shares each B tile, every block loading
// half of it and multicasting it into both blocks' shared memory.
#ifndef FE_CLUSTER
#define FE_CLUSTER 1
#endif
#ifndef FE_WGMMA_BF16
#define FE_WGMMA_BF16 1
#endif
// -DFE_WGMMA_TF32=1 (FE_ELEM float): f32 storage multiplied as tf32, wgmma m64n256k8.
#ifndef FE_WGMMA_TF32
#define FE_WGMMA_TF32 0
#endif
#if FE_WGMMA_TF32
#define FE_WG_TY "tf32"
#elif FE_WGMMA_BF16
#define FE_WG_TY "bf16"
#else
#define FE_WG_TY "f16"
#endif

// Element size, and k per stage: one 128-byte swizzle row (64 bf16/f16, 32 f32), so the ring's
// byte layout (and every descriptor offset below) is the same for 16-bit and tf32 inputs.
constexpr int ES = (int)sizeof(T);
constexpr int BM = 128, BN = 256, BK = 128 / ES, STAGES = FE_STAGES, CL = FE_CLUSTER;
// k of one wgmma: 32 bytes of a K-major row (k16 for 16-bit inputs, k8 for tf32).
constexpr int KSTEP = 32 / ES;
static_assert(CL == 1 || CL == 2, "cluster of 1 or 2 blocks");
constexpr int NTHREADS = 384;
constexpr int A_MN = FE_A_TRANS;      // A stored m-contiguous: MN-major smem operand
constexpr int B_MN = FE_B_TRANS ? 0 : 1;  // B stored n-contiguous (not transposed): MN-major
constexpr int A_BYTES = BM * BK * ES, B_BYTES = BN * BK * ES;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int BOX64 = 64 * 128;  // one 64-wide MN box of 64 k rows (16-bit): 8 KiB
// -DFE_TMA_STORE=1 (16-bit C; the plain or the pair epilogue): the consumers write C (and Z)
// through shared memory and TMA stores instead of from registers straight to global memory (see
// store_warp_tma below).
#ifndef FE_TMA_STORE
#define FE_TMA_STORE 0
#endif
// -DFE_GROUPED (moe's grouped GEMM; see the end of this comment block): 1 = M-grouped, 2 =
// K-grouped. The kernel takes two more parameters, `gend` (int32, `groups` cumulative row ends:
// group g owns rows [gend[g-1], gend[g]) of A (M-grouped) or of A and B (K-grouped), gend[-1] = 0)
// and `groups`.
// - M-grouped (C = A·B_g per group of rows; torch._grouped_mm with 2-D A and 3-D B): group g's row
//   tiles start at its first row (any row: TMA loads from any coordinate), B's batch coordinate is
//   g, C has no batch. The walk is over the tiles of every group (prefix sums of their row-tile
//   counts in shared memory, computed by each block at start from gend: no host synchronisation,
//   so the launch can be captured in a CUDA graph); a tile's rows past its group's end are
//   computed from the next group's rows and not stored (a warp whose 16 rows all lie in the group
//   takes the TMA store, the others the predicated register stores).
// - K-grouped (C_g = A_gᵀ·B_g: a weight gradient, batch g): k runs over group g's rows only, in
//   whole BK slices: every group's start must be a multiple of BK and every end too unless it is
//   the last row of the operands (TMA zero-fills there); the caller pads (moe's padded layout).
//   An empty group writes alpha·0 (+ beta·C).
#ifndef FE_GROUPED
#define FE_GROUPED 0
#endif
#if FE_GROUPED
#define FE_GROUPED_PARAMS , const int* __restrict__ gend, int groups
// Most groups one launch takes (the prefix sums live in shared memory; the host checks).
constexpr int MAX_GROUPS = 1024;
#else
#define FE_GROUPED_PARAMS
#endif
// -DFE_GLU = 1 + act (FE_EPI's activation codes; with FE_GROUPED == 1, B not transposed, the
// TMA store): the up projection of a GLU MLP (moe's `fused` variant) with the GLU in its
// epilogue. B is `[groups][k][n]` with n = 2·nh columns, the gate's nh first and then the up's;
// C is the GLU output `[m][nh]` (ldc = nh). A tile's 256 B columns are the gate's columns
// [128·tn, 128·tn + 128) and the up's columns nh + the same (two 64-wide boxes each; gate boxes
// past nh read up columns, whose products are never stored), so every thread holds the gate and
// the up value of its output columns in accumulators j and j + 16: C = act(gate) ⊙ up goes out
// straight from the registers, and the GLU pass over a [m][2·nh] buffer (its read, and its launch)
// is gone. With store_tma & 2 the pre-activations (the backward's input) are stored too, to
// `glu_h` `[m][n]` (gate | up, as the unfused GEMM writes them) through tma_z, a map of
// (column, half, row). Both are rounded to T before the product, so C is bit for bit what the
// unfused GEMM + GLU pass write (given the same activation formulas). Needs nh % 8 == 0.
#ifndef FE_GLU
#define FE_GLU 0
#endif
#if FE_GLU
#define FE_GLU_PARAMS , T* __restrict__ glu_h
static_assert(FE_GROUPED == 1 && FE_TMA_STORE && !FE_EPI && !FE_B_TRANS,
              "GLU epilogue: M-grouped, TMA store, B [k][n]");
#else
#define FE_GLU_PARAMS
#endif
// The C staging area: per consumer warp, SBUF buffers of one 16-row × 64-column box (2 KiB,
// 128-byte swizzled, the layout the TMA store reads), after the ring.
// - Plain C and the activation backward (FE_EPI_DACT): SBUF = 4, the warp's whole 16 × 256 slice
//   (64 KiB for the block) beside a 3-stage ring (144 KiB; the host compiles these builds with 3
//   stages). With 2 buffers beside 4 stages (an earlier layout) each warp waited twice per tile
//   for the TMA unit to finish reading a buffer, with the tensor cores idle. Sustained on the
//   H100 at the 700 W limit (bench/results/2026-11-26-h100-gemm-sustained-linear-bwd:
//   no-store-ablation, whole-slice-staging, whole-slice-all-builds): with no store at all the GEMM
//   ran 1.429 ms against 1.481 at 8192×14336×4096 — the epilogue cost ~3.5% — and whole-slice
//   staging took it to 1.446–1.467 (0.936–0.940 → 0.955–0.956× cuBLAS; 8192×4096×14336 0.972 →
//   0.979×, 8192×4096×4096 0.942 → 0.949×); one stage less of lookahead cost nothing measurable
//   (bench/results/2026-11-25-h100-linear-dact-helpers/helpers-first-version).
// - The pair epilogue (bias, activation, Z): SBUF = 2 (32 KiB) beside 4 stages: with 3 stages
//   and whole slices its forward ran up to 8% slower at 8192×4096←4096 (whole-slice-all-builds).
#if FE_EPI && !FE_EPI_DACT
constexpr int SBUF = 2;
#else
constexpr int SBUF = 4;
#endif
constexpr int SBOX = 16 * 128;
constexpr int STAGING_BYTES = FE_TMA_STORE ? 8 * SBUF * SBOX : 0;
static_assert(!FE_TMA_STORE || SBUF == 2 || STAGES <= 3,
              "whole-slice staging beside a 3-stage ring (227 KiB per block)");
static_assert(!FE_EPI_DACT || FE_TMA_STORE, "DACT: TMA store");
static_assert(!FE_TMA_STORE || (ES == 2 && (!FE_EPI || FE_EPI_PAIRS)),
              "TMA store: plain or pair epilogue, 16-bit C");
#if FE_WGMMA_TF32
static_assert(ES == 4, "tf32 wgmma takes f32 storage");
// wgmma has no transpose bit for tf32: both operands must be K-major in shared memory. The host
// compiles only NT (A row-major, B transposed) and first packs an m/n-contiguous operand into a
// K-major tf32-rounded copy (matmul_wgmma_pack below).
static_assert(!A_MN && !B_MN, "tf32 wgmma reads K-major operands only");
#else
static_assert(ES == 2, "16-bit wgmma kernel takes f16/bf16 storage");
#endif

// ---- the TMA-store epilogue (tma_store, bulk groups, stmatrix_x4: hopper.cuh) ----
__device__ __forceinline__ unsigned pack_u32(float a, float b) {
  const T2 v = fe_pack2<T2>(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}

#if FE_TMA_STORE
// One consumer warp's 16 rows × 256 columns of the tile to the tensor map's (row, n0, z), as four
// boxes of 16 × 64 through the warp's SBUF staging buffers at stg. Per box: the warp waits until
// the box that last used the buffer has been read out (lane 0 owns the bulk groups), then, for
// each pair of 8-column groups p, vals(j, v) gives the thread's values of column groups j = 8q + 2p
// and j + 1, packed (pack_u32): v = {rows lane/4, lane/4 + 8 of group j, the same of group j + 1}
// — in the wgmma accumulator layout d[4j + 2i], d[4j + 2i + 1] is row lane/4 + 8i, columns
// 8j + 2(lane%4), +1 — and one stmatrix.x4 writes those 4 8×8 matrices into the 128-byte-swizzled
// box (16-byte chunk c of row r at r·128 + 16·(c ^ r%8): a matrix's 8 rows land in 8 different
// bank groups). Then a fence for the async proxy, and lane 0 issues the store. Values are made
// 4 pairs at a time so a fused epilogue's activation temporaries stay few. The TMA unit writes
// whole lines and skips everything outside the tensor (edges need no predicates); the warp goes
// on while the stores drain.
// `before(q)` runs first in box q's turn (the activation-backward epilogue loads the next box's
// operands there), `after(q, buf)` last, once the box is in the staging buffer `buf` and its
// store issued (the buffer is rewritten only SBUF boxes later, after the warp's next barrier).
// Box q of the warp's slice into the staging buffer buf (the stmatrix part of store_warp_tma).
template <class Vals>
__device__ __forceinline__ void stage_box(const Vals& vals, int q, unsigned buf, int lane) {
  const unsigned lr = lane & 7, mat = lane >> 3;
  const unsigned lane_row = ((mat & 1) * 8 + lr) * 128;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    unsigned v[4];
    vals(8 * q + 2 * p, v);
    // Matrices 0, 1: column group 2p of the box, rows 0–7 and 8–15; matrices 2, 3: group 2p+1.
    const unsigned chunk = 2 * p + (mat >> 1);
    stmatrix_x4(buf + lane_row + ((chunk ^ lr) << 4), v[0], v[1], v[2], v[3]);
  }
}
// Box q of the warp's values through staging buffer buf to the map's (c0, c1, c2): once the box
// that last used the buffer has been read out, stage, fence for the async proxy, and lane 0
// issues the store.
template <class Vals>
__device__ __forceinline__ void store_box(const Vals& vals, int q, unsigned buf,
                                          const TmaDesc* map, int c0, int c1, int c2, int lane) {
  if (lane == 0) bulk_wait_read<SBUF - 1>();
  __syncwarp();
  stage_box(vals, q, buf, lane);
  fence_async_smem();
  __syncwarp();
  if (lane == 0) {
    tma_store(map, buf, c0, c1, c2);
    bulk_commit();
  }
}
template <class Vals, class Before, class After>
__device__ __forceinline__ void store_warp_tma(const Vals& vals, const Before& before,
                                               const After& after, unsigned stg,
                                               const TmaDesc* map, int row, int n0, int z,
                                               int lane) {
#pragma unroll
  for (int q = 0; q < BN / 64; ++q) {
    before(q);
    const unsigned buf = stg + (q % SBUF) * SBOX;
    store_box(vals, q, buf, map, n0 + 64 * q, row, z, lane);
    after(q, buf);
  }
}
template <class Vals>
__device__ __forceinline__ void store_warp_tma(const Vals& vals, unsigned stg, const TmaDesc* map,
                                               int row, int n0, int z, int lane) {
  store_warp_tma(vals, [](int) {}, [](int, unsigned) {}, stg, map, row, n0, z, lane);
}
#endif

#if FE_GLU
// The GLU of the thread's pair (column group j < 16, row half i): the gate and up pre-activations
// rounded to T (returned in g, u as floats) and act(gate) ⊙ up, rounded and packed.
__device__ __forceinline__ unsigned glu_pair(const float (&d)[128], int j, int i, float2& g,
                                             float2& u) {
  const float2 g2 = fe_f2(fe_pack2<T2>(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]));
  const float2 u2 = fe_f2(fe_pack2<T2>(d[4 * (j + 16) + 2 * i], d[4 * (j + 16) + 2 * i + 1]));
  g = g2;
  u = u2;
  return pack_u32(fe_act_of<FE_GLU, true>(g2.x) * u2.x, fe_act_of<FE_GLU, true>(g2.y) * u2.y);
}

// One consumer warp's 16 rows of a GLU tile through the TMA store: with keep_h the 256
// pre-activation columns (boxes 0–1 the gate's, 2–3 the up's: half q / 2 of map_h, a map of
// (column, half, row)), then the 128 GLU columns (2 boxes of map_c). Staging buffers rotate as
// in store_warp_tma.
__device__ __forceinline__ void glu_store_tma(const float (&d)[128], unsigned stg,
                                              const TmaDesc* map_c, const TmaDesc* map_h,
                                              bool keep_h, int row, int hc, int lane) {
  int b = 0;
  auto box = [&](auto vals, int q, const TmaDesc* map, int c0, int c1, int c2) {
    store_box(vals, q, stg + (b++ % SBUF) * SBOX, map, c0, c1, c2, lane);
  };
  if (keep_h) {
    const auto pre = [&](int j, unsigned(&v)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int jj = j + e / 2, i = e % 2;
        v[e] = pack_u32(d[4 * jj + 2 * i], d[4 * jj + 2 * i + 1]);
      }
    };
#pragma unroll
    for (int q = 0; q < 4; ++q) box(pre, q, map_h, hc + 64 * (q % 2), q / 2, row);
  }
  const auto glu = [&](int j, unsigned(&v)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float2 g, u;
      v[e] = glu_pair(d, j + e / 2, e % 2, g, u);
    }
  };
#pragma unroll
  for (int q = 0; q < 2; ++q) box(glu, q, map_c, hc + 64 * q, row, 0);
}
#endif

#if FE_WGMMA_TF32
#define FE_WG_K "8"
#else
#define FE_WG_K "16"
#endif
// d (64×256 fp32, wgmma accumulator layout) += A(64×KSTEP, desc da) · B(KSTEP×256, desc db).
// (The tf32 form has no transpose immediates; %131/%132 are then unused.)
__device__ __forceinline__ void wgmma_256(float (&d)[128], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k" FE_WG_K ".f32." FE_WG_TY "." FE_WG_TY " {"
      FE_ACC_SLOTS128
#if FE_WGMMA_TF32
      "}, %128, %129, p, 1, 1;\n}\n"
#else
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
#endif
      : FE_ACC128(d)
      : "l"(da), "l"(db), "r"(scale_d), "n"(A_MN), "n"(B_MN));
}

// Tile t of the persistent walk: batch z, row tile tm, column tile tn (grouped order).
__device__ __forceinline__ void tile_of(i64 t, i64 tiles_m, i64 tiles_n, i64 group_m, i64& z,
                                        i64& tm, i64& tn) {
  const i64 per = tiles_m * tiles_n;
  z = t / per;
  const i64 r = t - z * per;
  const i64 group = group_m * tiles_n;
  const i64 g = r / group;
  const i64 first = g * group_m;
  const i64 gm = min(group_m, tiles_m - first);
  const i64 q = r - g * group;
  tm = first + q % gm;
  tn = q / gm;
}

// Where tile t of the walk lies: batch (or group) z, tile coordinates, its first row m0, the end
// of its valid rows mend, its first k k0 and number of k slices.
struct Loc {
  i64 z, tm, tn;
  int m0, mend, k0, ktiles;
};

#if FE_GROUPED
// Group g's first row.
__device__ __forceinline__ int gstart(const int* gend, int g) { return g > 0 ? gend[g - 1] : 0; }
#endif

#if FE_GROUPED == 1
// M-grouped: the group holding walk tile t (cum: inclusive prefix sums of each group's tile count),
// then the tile inside it.
__device__ __forceinline__ Loc locate_m(i64 t, const i64* cum, int groups, const int* gend,
                                        i64 tiles_n, i64 group_m) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {  // first group whose inclusive sum exceeds t
    const int mid = (lo + hi) / 2;
    if (cum[mid] > t) hi = mid; else lo = mid + 1;
  }
  const int g = lo;
  const i64 before = g > 0 ? cum[g - 1] : 0;
  const int s = gstart(gend, g), e = gend[g];
  Loc l;
  l.z = g;
  tile_of(t - before, ceil_div((i64)(e - s), BM), tiles_n, group_m, l.z, l.tm, l.tn);
  l.z = g;
  l.m0 = s + (int)(l.tm * BM);
  l.mend = e;
  l.k0 = 0;
  return l;
}
#endif

#if FE_EPI && FE_EPI_PAIRS && FE_TMA_STORE
// The pair epilogue through the TMA store: Z = alpha·acc + bias (when asked), then
// Y = act(Z) (+ residual), each as store_warp_tma's boxes. The 4 residual pairs of one
// stmatrix are loaded before any of them is used; the bias pairs sit in registers since the
// tile started.
template <bool HZ, bool HR>
__device__ __forceinline__ void wg_epilogue_tma(const float (&d)[128], const T2 (&bias2)[BN / 8],
                                                float alpha, const T* rp, i64 ldr, unsigned stg,
                                                const TmaDesc* map_y, const TmaDesc* map_z,
                                                int row, int n0, int z, int lane) {
  // Pair (column group j, row half i): alpha·acc + bias.
  auto pre = [&](int j, int i) {
    const float2 b = fe_f2(bias2[j]);
    return make_float2(fmaf(alpha, d[4 * j + 2 * i], b.x), fmaf(alpha, d[4 * j + 2 * i + 1], b.y));
  };
  if (HZ)
    store_warp_tma(
        [&](int j, unsigned(&v)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 u = pre(j + e / 2, e % 2);
            v[e] = pack_u32(u.x, u.y);
          }
        },
        stg, map_z, row, n0, z, lane);
  store_warp_tma(
      [&](int j, unsigned(&v)[4]) {
        T2 rv[4];  // the 4 residual pairs, loaded before any is used
        if (HR) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            rv[e] = __ldg(reinterpret_cast<const T2*>(rp + (e % 2) * 8 * ldr + 8 * (j + e / 2)));
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 u = pre(j + e / 2, e % 2);
          float2 y = make_float2(fe_act(u.x), fe_act(u.y));
          if (HR) {
            const float2 r = fe_f2(rv[e]);
            y.x += r.x;
            y.y += r.y;
          }
          v[e] = pack_u32(y.x, y.y);
        }
      },
      stg, map_y, row, n0, z, lane);
}
#endif

#if FE_EPI && FE_EPI_PAIRS && FE_TMA_STORE
// k-steps before the epilogue at which the consumers ask L2 for the tile's R (residual, or the
// activation backward's pre-activation): ~8 × 0.8 µs ahead of its loads at 4096-deep k.
constexpr int R_PREFETCH_AHEAD = 8;
// The warp's 16 rows × BN columns of R into L2 (r at the warp's first row and the tile's first
// column; interior tiles only, so every line is inside R): lane → row lane/2, half lane%2 of the
// row's BN·ES bytes, the lines at its first, middle and last byte (a row need not start on a
// 128-byte line). Measured without it (docs/linear.md, "The chain form"): the
// activation-backward epilogue cost ~60 µs per 8192×4096 output (~7 µs per tile) — each box's R
// loads waited on DRAM with only one box of lookahead while the tensor cores idled.
__device__ __forceinline__ void prefetch_r_l2(const T* r, i64 ldr, int lane) {
  constexpr int HALF = BN * ES / 2;
  static_assert(HALF == 256, "three prefetches cover a 256-byte half row");
  const char* p = reinterpret_cast<const char*>(r + (lane / 2) * ldr) + (lane % 2) * HALF;
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + 128));
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + HALF - 1));
}
#endif

#if FE_EPI_DACT
// ---- the activation-backward epilogue: consumers stage, helpers finish ----
// Run in the consumer warps, the epilogue C = act'(R) ⊙ (alpha·acc) keeps the tensor cores
// idle: ~15% of the consumers' stall samples against ~6% for the plain store (Nsight Compute on
// the H100, bench/results/2026-11-25-h100-linear-dact-helpers/dact-sass-profile) — R's loads,
// act' (a tanh and ~10 FMAs per element), the column sums; leaving out any one of them changed
// nothing (dact-ablations, same folder). So the consumers only round alpha·acc to 16 bits and
// stmatrix their whole 16 × 256 slices into a tile-sized staging area (SBUF = 4 boxes per warp;
// the ring has 3 stages to make room), arrive on `stg_full` and start the next tile's mainloop.
// Warps 1–3 of the producer warpgroup (otherwise idle) wait on it; for each box they read R
// (16-byte loads, prefetched into L2 a tile ahead), multiply in place, add the column sums and
// hand the box to the TMA store; once the stores have read the area they arrive on `stg_empty`,
// which the consumers wait on before staging the next tile. The helpers' work for tile t runs
// under the mainloop of tile t + 1. The product is rounded twice (alpha·acc to 16 bits, then the
// product), as the unfused path (GEMM, then linear_dact) rounds it.
// What it costs (helpers-sass-profile, per SASS): the consumers' epilogue fell to a third of the
// plain kernel's, the helpers mostly wait for work, but the mainloop waits on its `full` barrier
// ~9× as often as the 4-stage plain kernel's: with 3 stages the producer has one stage of
// lookahead (the consumers hold two). Asking L2 for the boxes a ring ahead
// (cp.async.bulk.prefetch.tensor) made it slower still (ring-prefetch-no-cluster); a launch
// without a cluster (a stage no longer waits on the peer block's consumers) made it faster, and
// is what the host runs (matmul::cuda::WG_DACT).
// Over the plain dX GEMM of the same rounds (dact-no-cluster): +17–36 µs at k = 14336, +29–55 µs
// at 8192×4096←4096, +72–128 µs at 8192×14336 output with k = 4096 (~+45 µs at 8192×4096←4096
// with the epilogue in the consumers). Timed repeat by repeat beside it (the linear bench's
// interleaved timing): +37–40, +39–40, +65 µs
// (bench/results/2026-11-26-h100-linear-bench-timing-last-tile/sustained-timing).
// A block's last tile has no mainloop after it to hide the helpers' ~15–20 µs under: there the
// 8 consumer warps, done with their mainloop, wait on `stg_full` too and the 11 warps share the
// 32 boxes (`joined`; the boxes' column sums are the same bits whichever warp adds them).

// The warps that share a block's last tile (joined): the 3 helpers and the 8 consumer warps.
constexpr int DACT_WORKERS = 11;

// 16-byte shared-memory access at a u32 shared address.
__device__ __forceinline__ uint4 lds_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void sts_v4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ float2 u32_f2(unsigned u) {
  return fe_f2(*reinterpret_cast<const T2*>(&u));
}

// R of the staged halves of the tile at (m0, n0) into L2, by the 96 helper lanes (h·32 + lane):
// 128 rows × 4 lines of 128 bytes. Issued a tile ahead, so the helpers' loads hit L2.
__device__ __forceinline__ void dact_prefetch_r(const T* r, i64 ldr, int m0, int n0, bool staged0,
                                                bool staged1, int h, int lane) {
  for (int li = h * 32 + lane; li < BM * 4; li += 96) {
    const int row = li >> 2;
    if (!(row < 64 ? staged0 : staged1)) continue;
    const T* p = r + (i64)(m0 + row) * ldr + n0 + (li & 3) * 64;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  }
}

// Worker warp h (0..nh−1)'s boxes of the staged tile at tile row m0, column n0: boxes b = h,
// h + nh, ... of the 32 (consumer warp b/4's box b%4), those of a consumer half that staged
// (`staged0`
// rows 0–63, `staged1` rows 64–127). Lane l owns the 16-byte chunk l%8 (8 columns) of rows
// l/8, l/8 + 4, l/8 + 8, l/8 + 12 of the box: a warp access is 4 whole 128-byte rows, in shared
// memory (at their swizzled places: conflict-free) as in R; R was prefetched into L2 a tile
// ahead (loading the next box's R under this one's math as well made ptxas spill at 72
// registers). With `part` (the [m/16][ldp] f32 column partial sums), each box's 16-row
// sums of the rounded products: each lane's 4 rows in order, then the 4 lanes of a chunk added
// by two fixed butterfly steps — the same bits on every run.
template <int NH>
__device__ __forceinline__ void dact_helper_tile(unsigned staging, const TmaDesc* map, const T* r,
                                                 i64 ldr, float* part, i64 ldp, int m0, int n0,
                                                 int z, bool staged0, bool staged1, int h,
                                                 int lane) {
  const int ch = lane & 7, rsub = lane >> 3;
  auto staged_box = [&](int b) { return (b >> 2) < 4 ? staged0 : staged1; };
  auto next_box = [&](int b) {
    while (b < 32 && !staged_box(b)) b += NH;
    return b;
  };
  // Every row of a staged box is inside R (the half staged only if its 64 rows and the tile's
  // 256 columns are inside C, and R is indexed like C).
  auto load_r = [&](int b, uint4(&v)[4]) {
    const T* p = r + (i64)(m0 + 16 * (b >> 2) + rsub) * ldr + n0 + 64 * (b & 3) + 8 * ch;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __ldg(reinterpret_cast<const uint4*>(p + 4 * i * ldr));
  };
  uint4 cur[4];
  for (int b = next_box(h); b < 32; b = next_box(b + NH)) {
    load_r(b, cur);
    const int w = b >> 2, q = b & 3;
    const unsigned buf = staging + (w * SBUF + q) * SBOX;
    float cs[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) cs[e] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = 4 * i + rsub;
      const unsigned addr = buf + rr * 128 + ((ch ^ (rr & 7)) << 4);
      const uint4 cv = lds_v4(addr);
      const unsigned cu[4] = {cv.x, cv.y, cv.z, cv.w};
      const unsigned gu[4] = {cur[i].x, cur[i].y, cur[i].z, cur[i].w};
      unsigned ou[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 c2 = u32_f2(cu[e]), g = u32_f2(gu[e]);
        ou[e] = pack_u32(c2.x * fe_dact(g.x), c2.y * fe_dact(g.y));
        const float2 o = u32_f2(ou[e]);
        cs[2 * e] += o.x;
        cs[2 * e + 1] += o.y;
      }
      sts_v4(addr, make_uint4(ou[0], ou[1], ou[2], ou[3]));
    }
    if (part) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 8);
        cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 16);
      }
      if (rsub == 0) {
        float4* pp = reinterpret_cast<float4*>(part + (i64)((m0 + 16 * w) >> 4) * ldp + n0 + 64 * q +
                                               8 * ch);
        pp[0] = make_float4(cs[0], cs[1], cs[2], cs[3]);
        pp[1] = make_float4(cs[4], cs[5], cs[6], cs[7]);
      }
    }
    fence_async_smem();
    __syncwarp();
    if (lane == 0) tma_store(map, buf, n0 + 64 * q, m0 + 16 * w, z);
  }
  // The area is free again once the stores have read it.
  if (lane == 0) {
    bulk_commit();
    bulk_wait_read<0>();
  }
  __syncwarp();
}
#endif


// The activation-backward build has its own name, so profilers and traces tell it from the plain
// GEMM it runs beside in a backward (matmul::cuda::wgmma_function).
#if FE_EPI_DACT
#define FE_WGMMA_FN matmul_wgmma_dact
#else
#define FE_WGMMA_FN matmul_wgmma
#endif
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
#if FE_CLUSTER > 1
    __cluster_dims__(FE_CLUSTER, 1, 1)
#endif
    FE_WGMMA_FN(FE_MATMUL_PARAMS, const __grid_constant__ TmaDesc tma_a,
                 const __grid_constant__ TmaDesc tma_b, const __grid_constant__ TmaDesc tma_c,
                 const __grid_constant__ TmaDesc tma_z, int group_m, int store_tma,
                 int splitk FE_EPI_PARAMS
                 FE_GROUPED_PARAMS FE_GLU_PARAMS) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + 1023) & ~1023u;  // 128B swizzle atoms are 1024-byte aligned
  const unsigned staging = base + STAGES * STAGE_BYTES;  // FE_TMA_STORE: C boxes, per warp
  const unsigned full0 = staging + STAGING_BYTES;        // full[s] at full0 + 8s
  const unsigned empty0 = full0 + STAGES * 8;            // empty[s] at empty0 + 8s
#if FE_EPI_DACT
  // The staging handshake of the activation-backward epilogue (dact_helper_tile).
  const unsigned stg_full = empty0 + STAGES * 8, stg_empty = stg_full + 8;
  constexpr unsigned EXTRA_BARRIERS = 16;
#else
  constexpr unsigned EXTRA_BARRIERS = 0;
#endif
  // The host sizes the dynamic shared memory (cuda.rs, wg_smem); a smaller one would overrun.
  if (dynamic_smem_bytes() < (empty0 + STAGES * 8 + EXTRA_BARRIERS) - raw) __trap();

  // The walk is over cluster tiles (CL·BM rows × BN): block `rank` of a cluster takes row tile
  // CL·tm + rank (past the last row tile it computes zeros and writes nothing).
  const i64 tiles_m = ceil_div(ceil_div(m, BM), CL), tiles_n = ceil_div(n, BN);
#if FE_GROUPED == 1
  static_assert(CL == 1 && !FE_EPI, "grouped: no cluster, plain epilogue");
  // Inclusive prefix sums of each group's tile count (warp 0, 32 groups per step).
  __shared__ i64 cum[MAX_GROUPS];
  if (threadIdx.x < 32) {
    i64 carry = 0;
    for (int g0 = 0; g0 < groups; g0 += 32) {
      const int g = g0 + threadIdx.x;
      i64 v = g < groups ? ceil_div((i64)(gend[g] - gstart(gend, g)), BM) * tiles_n : 0;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const i64 u = __shfl_up_sync(0xffffffffu, v, o);
        if ((int)threadIdx.x >= o) v += u;
      }
      if (g < groups) cum[g] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
  const i64 total = cum[groups - 1];
#elif FE_GROUPED == 2
  static_assert(CL == 1 && !FE_EPI, "grouped: no cluster, plain epilogue");
  const i64 total = tiles_m * tiles_n * groups;
#else
  const i64 total = tiles_m * tiles_n * batch;
#endif
  const unsigned rank = CL > 1 ? cluster_rank() : 0;
  const i64 first_tile = blockIdx.x / CL, tile_step = gridDim.x / CL;
  const int ktiles = (int)ceil_div(k, BK);
  // Tile t of the walk (for the plain kernel: tile_of, rows up to m, all of k).
  auto locate = [&](i64 t) {
    Loc l;
#if FE_GROUPED == 1
    l = locate_m(t, cum, groups, gend, tiles_n, group_m);
    l.ktiles = ktiles;
#else
    tile_of(t, tiles_m, tiles_n, group_m, l.z, l.tm, l.tn);
    l.tm = l.tm * CL + rank;
    l.m0 = (int)(l.tm * BM);
    l.mend = (int)m;  // m < 2^31 - 256 (host-checked)
#if FE_GROUPED == 2
    const int s = gstart(gend, (int)l.z);
    l.k0 = s;
    l.ktiles = (int)ceil_div((i64)(gend[l.z] - s), BK);
#else
    l.k0 = 0;
    l.ktiles = ktiles;
#if !FE_GROUPED && !FE_EPI
    if (splitk) {
      // Split-K: z is the split, taking k tiles [z·per, z·per + per) ∩ [0, ktiles) of unbatched
      // A and B (their batch coordinate is 0: the host passes batch strides 0).
      const int per = (int)ceil_div((i64)ktiles, batch);
      const int first = (int)l.z * per;
      l.k0 = first * BK;
      l.ktiles = max(0, min(per, ktiles - first));
    }
#endif
#endif
#endif
    return l;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8 * CL);  // one arrival per consumer warp of the cluster
    }
#if FE_EPI_DACT
    // Every thread of the handoff arrives (not one per warp after a __syncwarp): each thread's
    // staging accesses are then released by its own arrival, which is what racecheck follows —
    // with the boxes changing hands on a block's last tile (joined), one-lane arrivals showed
    // as hazards there
    // (bench/results/2026-11-26-h100-linear-bench-timing-last-tile/racecheck-reports).
    mbar_init(stg_full, 256);  // each consumer thread, once per tile
    mbar_init(stg_empty, 96);  // each helper thread, once per tile
#endif
    fence_barrier_init();
  }
  if (CL > 1)
    cluster_sync();  // the peer's barriers are initialised before anyone arrives on them
  else
    __syncthreads();

#if FE_EPI_DACT
  // Whether consumer half `half` of tile (tm, tn) stages its slice for the helpers: every row and
  // column inside C, TMA-storable C and aligned pairs of C and R. Consumers and helpers decide
  // alike; the other halves take the element-wise store loop.
  const FeEpi epi_h = FE_EPI_MAKE;
  const bool dact_pairs = store_tma && beta == 0.f && ((u64)C % (2 * ES) == 0) && (ldc % 2 == 0) &&
                          (stride_c % 2 == 0) && fe_pairs_aligned(epi_h.r, epi_h.ldr, epi_h.stride_r);
  auto staged = [&](i64 tm, i64 tn, int half) {
    return dact_pairs && (tn + 1) * BN <= n && tm * BM + half * 64 + 64 <= m;
  };
  // Whether the 8 consumer warps join the 3 helpers on tile t (both halves staged): on a block's
  // last tile no mainloop follows for the helpers' work to hide under, so 11 warps share it.
  auto joined = [&](i64 t, bool s0, bool s1) { return t + tile_step >= total && s0 && s1; };
#endif
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
#if FE_EPI_DACT
    // 88 for the helper warps (their 4 16-byte R loads and 8 column sums; at 72–80 ptxas spilled
    // in some activations), 208 for the consumers: 128·88 + 256·208 = the 384·168 allocated.
    regs_dec<88>();
#else
    regs_dec<40>();
#endif
    if (threadIdx.x == 0) {
      prefetch_tensormap(&tma_a);
      prefetch_tensormap(&tma_b);
      int s = 0;
      unsigned ph = 0;
      for (i64 t = first_tile; t < total; t += tile_step) {
        const Loc l = locate(t);
        // GLU: n0 is the tile's first gate column; its up columns start at n / 2 + n0.
        const int m0 = l.m0, n0 = (int)(l.tn * (FE_GLU ? BN / 2 : BN));
        const int za = stride_a ? (int)l.z : 0, zb = stride_b ? (int)l.z : 0;
        for (int kt = 0; kt < l.ktiles; ++kt) {
          mbar_wait(empty0 + 8 * s, ph ^ 1);
          const unsigned bar = full0 + 8 * s;
          mbar_expect_tx(bar, STAGE_BYTES);
          const unsigned sa = base + s * STAGE_BYTES, sb = sa + A_BYTES;
          const int k0 = l.k0 + kt * BK;
          if (A_MN) {
            tma_load(sa, &tma_a, bar, m0, k0, za);
            tma_load(sa + BOX64, &tma_a, bar, m0 + 64, k0, za);
          } else {
            tma_load(sa, &tma_a, bar, k0, m0, za);
          }
          if (CL == 1) {
            if (B_MN) {
#pragma unroll
              for (int i = 0; i < BN / 64; ++i) {
                const int col = FE_GLU && i >= 2 ? (int)(n / 2) + n0 + 64 * (i - 2) : n0 + 64 * i;
                tma_load(sb + i * BOX64, &tma_b, bar, col, k0, zb);
              }
            } else {
              tma_load(sb, &tma_b, bar, k0, n0, zb);
            }
          } else {
            // This block's share of B (columns rank·BN/CL ...), multicast to the whole cluster.
            constexpr unsigned short all = (1u << CL) - 1;
            constexpr int bn = BN / CL;
            if (B_MN) {
#pragma unroll
              for (int i = 0; i < bn / 64; ++i) {
                const int col = (int)rank * bn + 64 * i;
                tma_load_mc(sb + col / 64 * BOX64, &tma_b, bar, n0 + col, k0, zb, all);
              }
            } else {
              tma_load_mc(sb + rank * (B_BYTES / CL), &tma_b, bar, k0, n0 + (int)rank * bn, zb, all);
            }
          }
          if (++s == STAGES) {
            s = 0;
            ph ^= 1;
          }
        }
      }
    }
#if FE_EPI_DACT
    else if (threadIdx.x >= 32) {
      // ---- helpers (warps 1–3): the activation-backward epilogue of the staged tiles ----
      const int h = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
      // R of tile t into L2: issued when the helpers start tile t − 1 (the first at once).
      auto prefetch = [&](i64 t) {
        if (t >= total) return;
        i64 z, tm, tn;
        tile_of(t, tiles_m, tiles_n, group_m, z, tm, tn);
        tm = tm * CL + rank;
        const bool s0 = staged(tm, tn, 0), s1 = staged(tm, tn, 1);
        if (s0 || s1)
          dact_prefetch_r(epi_h.r + z * epi_h.stride_r, epi_h.ldr, (int)(tm * BM), (int)(tn * BN),
                          s0, s1, h, lane);
      };
      prefetch(first_tile);
      unsigned fph = 0;
      for (i64 t = first_tile; t < total; t += tile_step) {
        i64 z, tm, tn;
        tile_of(t, tiles_m, tiles_n, group_m, z, tm, tn);
        tm = tm * CL + rank;
        mbar_wait(stg_full, fph);
        prefetch(t + tile_step);
        fph ^= 1;
        const bool s0 = staged(tm, tn, 0), s1 = staged(tm, tn, 1);
        // epi.part: [m/16][n] (batch 1), written only where the host checked that every tile
        // holding output rows stages (matmul::cuda::dact_colsum_ok).
        const T* rz = epi_h.r + z * epi_h.stride_r;
        const int m0 = (int)(tm * BM), n0 = (int)(tn * BN);
        if (joined(t, s0, s1))
          dact_helper_tile<DACT_WORKERS>(staging, &tma_c, rz, epi_h.ldr, epi_h.part, n, m0, n0,
                                         (int)z, s0, s1, h, lane);
        else if (s0 || s1)
          dact_helper_tile<3>(staging, &tma_c, rz, epi_h.ldr, epi_h.part, n, m0, n0, (int)z, s0,
                              s1, h, lane);
        mbar_arrive(stg_empty);
      }
      // Shared memory stays allocated until the last stores have read it.
      if (lane == 0) bulk_wait<0>();
    }
#endif
  } else {
    // ---- consumers: warpgroup c owns rows 64c..64c+63 of the tile ----
#if FE_EPI_DACT
    regs_inc<208>();
#else
    regs_inc<232>();
#endif
    const int c = wg - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    // Pairs of C (2 elements: 4 bytes for 16-bit, 8 for f32) stored as one access when aligned.
    const bool pair_ok = ((u64)C % (2 * ES) == 0) && (ldc % 2 == 0) && (stride_c % 2 == 0);
#if FE_EPI
    // The epilogue (bias, Z, activation, residual; common.cuh) needs each element's global row
    // and column: col is the thread's fragment column tn·BN + 8j + 2(lane%4) (+1), row its
    // fragment row. With FE_EPI_PAIRS interior tiles take wg_epilogue_tma (pairs, TMA stores,
    // no predicates) where the host allows the TMA store; edge tiles, beta ≠ 0, unaligned
    // operands and the FE_EPI_PAIRS=0 kernel the element-wise store loop below.
    const FeEpi epi = FE_EPI_MAKE;
#endif
#if FE_EPI && FE_EPI_PAIRS && !FE_EPI_DACT
    // (The DACT build decides with `staged`, helpers and consumers alike.)
    const bool epi_pairs = pair_ok && beta == 0.f && fe_pairs_aligned(epi.bias, 0, 0) &&
                           fe_pairs_aligned(epi.z, epi.ldz, epi.stride_z) &&
                           fe_pairs_aligned(epi.r, epi.ldr, epi.stride_r);
#endif
    // A stage is free again once every consumer warp of the cluster is done with it (the
    // peers' producers multicast into it too).
    auto release = [](unsigned bar) {
      if (CL == 1) {
        mbar_arrive(bar);
      } else {
#pragma unroll
        for (int r = 0; r < CL; ++r) mbar_arrive_cluster(bar, r);
      }
    };
    float d[128];
    int s = 0;
    unsigned ph = 0;
#if FE_EPI_DACT
    unsigned eph = 0;  // stg_empty's parity
#endif
    for (i64 t = first_tile; t < total; t += tile_step) {
      const Loc l = locate(t);
      const i64 z = l.z, tm = l.tm, tn = l.tn;
#if FE_EPI && FE_EPI_PAIRS && !FE_EPI_DACT
      // (store_tma is tested at the store, not here: folded in here, ptxas spilled 24 bytes in
      // the f16 GELU-erf kernel.)
      const bool fast = epi_pairs && (tn + 1) * BN <= n && tm * BM + c * 64 + 64 <= m;
      // The thread's 32 bias pairs, loaded before the mainloop (32 independent 4-byte loads, 32
      // registers beside the 128 accumulators): their latency hides behind the k-loop.
      T2 bias2[BN / 8];
      if (fast && epi.bias) {
        const T* bp = epi.bias + tn * BN + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) bias2[j] = __ldg(reinterpret_cast<const T2*>(bp + 8 * j));
      } else {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) bias2[j] = fe_pack2<T2>(0.f, 0.f);
      }
#endif
#pragma unroll
      for (int i = 0; i < 128; ++i) d[i] = 0.f;
      acc_fence(d);
      int prev = -1;
#if FE_EPI && FE_EPI_PAIRS && FE_TMA_STORE && !FE_EPI_DACT
      const int pf_kt = ktiles > R_PREFETCH_AHEAD ? ktiles - R_PREFETCH_AHEAD : 0;
#endif
      for (int kt = 0; kt < l.ktiles; ++kt) {
        mbar_wait(full0 + 8 * s, ph);
        const unsigned sa = base + s * STAGE_BYTES, sb = sa + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / KSTEP; ++kk) {
          // K-major: the kk-th 32-byte slice of each 128-byte row; MN-major (16-bit only): the
          // kk-th block of 16 k rows (2 KiB) of each 64-wide box.
          const u64 da = A_MN ? smem_desc(sa + c * BOX64 + kk * 2048, BOX64, 1024)
                              : smem_desc(sa + c * BOX64 + kk * 32, 16, 1024);
          const u64 db = B_MN ? smem_desc(sb + kk * 2048, BOX64, 1024)
                              : smem_desc(sb + kk * 32, 16, 1024);
          wgmma_256(d, da, db, 1);
        }
        wgmma_commit();
#if FE_EPI && FE_EPI_PAIRS && FE_TMA_STORE && !FE_EPI_DACT
        if (kt == pf_kt && fast && store_tma && epi.r)
          prefetch_r_l2(epi.r + z * epi.stride_r + (tm * BM + c * 64 + warp * 16) * epi.ldr + tn * BN,
                        epi.ldr, lane);
#endif
        wgmma_wait<1>();
        if (prev >= 0 && lane == 0) release(empty0 + 8 * prev);
        prev = s;
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
      wgmma_wait<0>();
      acc_fence(d);
      if (prev >= 0 && lane == 0) release(empty0 + 8 * prev);

      // Epilogue: thread holds rows r, r+8 and column pairs 8j + 2(lane%4) of its warp's 16 rows.
      const i64 row0 = l.m0 + c * 64 + warp * 16 + lane / 4;
      const i64 col0 = tn * BN + 2 * (lane % 4);
      T* Cz = C + z * stride_c;
      const i64 mend = l.mend;
#if FE_TMA_STORE
      // store_tma: beta == 0 and C's (and Z's) base, rows and batches 16-byte aligned
      // (host-checked); the pair epilogue takes it on interior tiles.
      const unsigned stg = staging + (c * 4 + warp) * SBUF * SBOX;
      const int srow = l.m0 + c * 64 + warp * 16, scol = (int)(tn * BN);
#if FE_EPI && FE_EPI_DACT
      {
        // Every warp, every tile: the helpers have drained the previous tile's staging (which
        // also keeps this warp's stg_full arrival in its own tile's phase, however far ahead
        // the warp runs), then alpha·acc rounded into the warp's slice, and the arrival.
        mbar_wait(stg_empty, eph ^ 1);
        eph ^= 1;
        const bool st = staged(tm, tn, c);
        if (st) {
          const auto vals = [&](int j, unsigned(&v)[4]) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int jj = j + e / 2, i = e % 2;
              v[e] = pack_u32(alpha * d[4 * jj + 2 * i], alpha * d[4 * jj + 2 * i + 1]);
            }
          };
#pragma unroll
          for (int q = 0; q < BN / 64; ++q) stage_box(vals, q, stg + q * SBOX, lane);
          __syncwarp();
        }
        mbar_arrive(stg_full);
        if (joined(t, staged(tm, tn, 0), staged(tm, tn, 1))) {
          // The block's last tile: once every consumer warp has staged (stg_full completes once
          // per tile, this is its (eph ^ 1) phase), this warp takes boxes as worker 3 + c·4 + warp.
          mbar_wait(stg_full, eph ^ 1);
          dact_helper_tile<DACT_WORKERS>(staging, &tma_c, epi.r + z * epi.stride_r, epi.ldr,
                                         epi.part, n, (int)(tm * BM), (int)(tn * BN), (int)z,
                                         true, true, 3 + c * 4 + warp, lane);
          if (lane == 0) bulk_wait<0>();
        }
        if (st) continue;
        (void)srow;
        (void)scol;
      }
      // Column sums are written by the helpers only: the host passes `epi.part` only when every
      // tile holding output rows stages (m % 64 == 0, n % BN == 0, TMA-storable C and aligned
      // R: matmul::cuda::dact_colsum_ok).
#elif FE_EPI
      if (store_tma && fast) {
        const T* rp = epi.r ? epi.r + z * epi.stride_r + row0 * epi.ldr + col0 : nullptr;
        if (epi.z) {
          if (rp)
            wg_epilogue_tma<true, true>(d, bias2, alpha, rp, epi.ldr, stg, &tma_c, &tma_z, srow,
                                        scol, (int)z, lane);
          else
            wg_epilogue_tma<true, false>(d, bias2, alpha, rp, epi.ldr, stg, &tma_c, &tma_z, srow,
                                         scol, (int)z, lane);
        } else {
          if (rp)
            wg_epilogue_tma<false, true>(d, bias2, alpha, rp, epi.ldr, stg, &tma_c, &tma_z, srow,
                                         scol, (int)z, lane);
          else
            wg_epilogue_tma<false, false>(d, bias2, alpha, rp, epi.ldr, stg, &tma_c, &tma_z,
                                          srow, scol, (int)z, lane);
        }
        continue;
      }
#elif FE_GLU
      {
        const int nh = (int)(n / 2), hc = (int)(tn * (BN / 2));
        const bool keep_h = store_tma & 2;
        if ((store_tma & 1) && srow + 16 <= mend) {
          glu_store_tma(d, stg, &tma_c, &tma_z, keep_h, srow, hc, lane);
          continue;
        }
        // A warp whose rows run past its group's end: predicated stores from registers.
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
          const int col = hc + 8 * j + 2 * (lane % 4);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const i64 row = row0 + 8 * i;
            if (row < mend && col < nh) {  // nh is even: col + 1 < nh too
              float2 g, u;
              const unsigned a = glu_pair(d, j, i, g, u);
              *reinterpret_cast<unsigned*>(C + row * ldc + col) = a;
              if (keep_h) {
                *reinterpret_cast<unsigned*>(glu_h + row * n + col) = pack_u32(g.x, g.y);
                *reinterpret_cast<unsigned*>(glu_h + row * n + nh + col) = pack_u32(u.x, u.y);
              }
            }
          }
        }
        continue;
      }
#else
      // Grouped: a warp whose rows run past its group's end stores from registers (the TMA
      // store would write the next group's rows); M-grouped C has no batch coordinate.
      if (store_tma && (!FE_GROUPED || srow + 16 <= mend)) {
        store_warp_tma(
            [&](int j, unsigned(&v)[4]) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int jj = j + e / 2, i = e % 2;
                v[e] = pack_u32(alpha * d[4 * jj + 2 * i], alpha * d[4 * jj + 2 * i + 1]);
              }
            },
            stg, &tma_c, srow, scol, FE_GROUPED == 1 ? 0 : (int)z, lane);
        continue;
      }
#endif
#endif
#if !FE_GROUPED && !FE_EPI && !FE_GLU && !FE_WGMMA_TF32
      if (splitk) {
        // Split-K: the raw fp32 partial tile into this split's slice of the workspace (C,
        // [splits][m][n], ldc = n); matmul_splitk_reduce sums the slices in split order.
        float* Wz = reinterpret_cast<float*>(C) + z * stride_c;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const i64 col = col0 + 8 * j;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const i64 row = row0 + 8 * i;
            if (row < mend && col < n) {
              float* p = Wz + row * ldc + col;
              const float a0 = d[4 * j + 2 * i], a1 = d[4 * j + 2 * i + 1];
              if (ldc % 2 == 0 && col + 1 < n) {
                *reinterpret_cast<float2*>(p) = make_float2(a0, a1);
              } else {
                p[0] = a0;
                if (col + 1 < n) p[1] = a1;
              }
            }
          }
        }
        continue;
      }
#endif
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const i64 col = col0 + 8 * j;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const i64 row = row0 + 8 * i;
          if (row < mend && col < n) {
            T* p = Cz + row * ldc + col;
            const float a0 = d[4 * j + 2 * i], a1 = d[4 * j + 2 * i + 1];
            if (pair_ok && col + 1 < n) {
              float v0 = alpha * a0, v1 = alpha * a1;
              if (beta != 0.f) {
                v0 = fmaf(beta, to_float(p[0]), v0);
                v1 = fmaf(beta, to_float(p[1]), v1);
              }
#if FE_EPI
              v0 = fe_epilogue(epi, v0, z, row, col);
              v1 = fe_epilogue(epi, v1, z, row, col + 1);
#endif
              struct alignas(2 * ES) Pair { T x, y; };
              *reinterpret_cast<Pair*>(p) = Pair{from_float<T>(v0), from_float<T>(v1)};
            } else {
#if FE_EPI
              fe_store_epi(p, a0, alpha, beta, epi, z, row, col);
              if (col + 1 < n) fe_store_epi(p + 1, a1, alpha, beta, epi, z, row, col + 1);
#else
              fe_store(p, a0, alpha, beta);
              if (col + 1 < n) fe_store(p + 1, a1, alpha, beta);
#endif
            }
          }
        }
      }
    }
#if FE_TMA_STORE
    // Shared memory stays allocated until the last stores have read it.
    if (lane == 0) bulk_wait<0>();
#endif
  }
  // No block leaves while its peer may still arrive on its barriers.
  if (CL > 1) cluster_sync();
}

#if FE_WGMMA_TF32

// The tf32 pre-pass for an operand TMA/wgmma cannot read as it is: m- or n-contiguous (A
// transposed, B not transposed: tf32 wgmma has no transpose bit), or k-contiguous with rows or
// base not 16-byte aligned. It writes the K-major copy Y[z][r][p] = tf32(op(X)[r][p]) =
// tf32(X[z·stride_x + r·sr + p·sp]) (r < rows, p < k; rows ldy apart, ldy a multiple of 4;
// batches rows·ldy apart), rounded to nearest (cvt.rna, as mma_pipelined rounds its fragments).
// m/n-contiguous sources (sr = 1) go through a 32×32 shared tile (rows padded to 33 floats:
// conflict-free both ways) so that reads are coalesced along r and writes along p; k-contiguous
// ones (sp = 1) are copied with lanes along p. One extra read and write of the operand: ≈ 45 µs
// for a 4096×4096 f32 operand at ~3 TB/s, against ≈ 0.4 ms of GEMM at 4096³.
extern "C" __global__ void __launch_bounds__(256)
    matmul_wgmma_pack(float* __restrict__ Y, const float* __restrict__ X, i64 rows, i64 k, i64 sr,
                      i64 sp, i64 stride_x, i64 ldy, i64 batch) {
  __shared__ float t[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;  // block 32×8
  const i64 r0 = (i64)blockIdx.x * 32;
  for (i64 z = blockIdx.z; z < batch; z += gridDim.z) {
    const float* Xz = X + z * stride_x;
    float* Yz = Y + z * rows * ldy;
    for (i64 p0 = (i64)blockIdx.y * 32; p0 < k; p0 += (i64)gridDim.y * 32) {
      if (sp == 1) {
#pragma unroll
        for (int i = ty; i < 32; i += 8) {
          const i64 r = r0 + i, p = p0 + tx;
          if (r < rows && p < k) Yz[r * ldy + p] = tf32_rna(Xz[r * sr + p]);
        }
        continue;  // block-uniform: no barrier skipped by part of the block
      }
#pragma unroll
      for (int i = ty; i < 32; i += 8) {
        const i64 p = p0 + i, r = r0 + tx;
        t[i][tx] = (p < k && r < rows) ? Xz[r * sr + p * sp] : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int i = ty; i < 32; i += 8) {
        const i64 r = r0 + i, p = p0 + tx;
        if (r < rows && p < k) Yz[r * ldy + p] = tf32_rna(t[tx][i]);
      }
      __syncthreads();
    }
  }
}
#endif

#if !FE_WGMMA_TF32
// The 16-bit pre-pass for an operand whose rows TMA cannot address: row pitch or batch stride not
// a multiple of 8 elements, or base not 16-byte aligned (4097 columns, a view at an odd offset).
// It copies each batch's `rows` × `cols` (the operand as stored, either major: wgmma reads both)
// to rows `ldy` apart (cols rounded up to 8, the pad written as zeros), batches rows·ldy apart, so
// the kernel then reads the copy through its usual tensor maps. Each thread writes one 16-byte
// chunk from 8 2-byte loads (the source chunk may start at any element; a warp's loads cover 512
// contiguous bytes, so the 8 instructions hit the same L1 lines). Block x walks a row's chunks, y
// the rows of every batch. One read and one write of the operand: ≈ 25 µs for a 4097×4097 bf16
// operand at ~2.7 TB/s, against ≈ 0.2–0.3 ms of wgmma GEMM at 4097³ (where mma_pipelined, the
// rung that reads unaligned rows directly, runs at about half of wgmma's rate).
// Split-K's second pass: C = alpha · Σ_z W[z] + beta · C, the fp32 partials of `splits` k-ranges
// (W [splits][m][n]) summed in split order (deterministic), rounded once into C (any ldc). Two
// outputs per thread, every load coalesced along n; the partials are m·n·splits·4 bytes, small
// next to the weight the splits read (split-K runs where m·n is a few tiles).
extern "C" __global__ void __launch_bounds__(256)
    matmul_splitk_reduce(T* __restrict__ C, const float* __restrict__ W, i64 m, i64 n, i64 ldc,
                         int splits, float alpha, float beta) {
  const i64 mn = m * n;
  for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 2; i < mn;
       i += (i64)gridDim.x * blockDim.x * 2) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const i64 idx = i + e;
      if (idx >= mn) break;
      float acc = 0.f;
      for (int z = 0; z < splits; ++z) acc += W[z * mn + idx];
      const i64 row = idx / n, col = idx - row * n;
      T* p = C + row * ldc + col;
      float v = alpha * acc;
      if (beta != 0.f) v = fmaf(beta, to_float(*p), v);
      *p = from_float<T>(v);
    }
  }
}

extern "C" __global__ void __launch_bounds__(128)
    matmul_wgmma_repitch(uint4* __restrict__ Y, const unsigned short* __restrict__ X, i64 rows,
                         i64 cols, i64 ldx, i64 stride_x, i64 ldy, i64 batch) {
  const i64 chunks = ldy / 8;
  const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const i64 c8 = c * 8;
  for (i64 rz = blockIdx.y; rz < batch * rows; rz += gridDim.y) {
    const i64 z = rz / rows, r = rz - z * rows;
    const unsigned short* src = X + z * stride_x + r * ldx + c8;
    unsigned v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (c8 + j < cols) ? (unsigned)src[j] : 0u;
    Y[rz * chunks + c] = make_uint4(v[0] | v[1] << 16, v[2] | v[3] << 16, v[4] | v[5] << 16,
                                    v[6] | v[7] << 16);
  }
}
#endif
