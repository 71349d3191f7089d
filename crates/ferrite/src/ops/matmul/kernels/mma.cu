// matmul/mma — steps 8 and 9 of the CUDA ladder: tensor cores through mma.sync (sm_80+).
//
// Specialised by -DFE_ELEM (__half, __nv_bfloat16, or float = tf32 inputs) and -DFE_STAGES:
// - `mma` (FE_STAGES=1): each 128×128 block tile (256 threads = 8 warps as 2×4, 64×32 per warp)
//   is built from warp-level `mma.sync.aligned.m16n8k16` (f16/bf16 inputs) or `m16n8k8` (tf32)
//   instructions with fp32 accumulators, 64 per thread. Operand fragments come from shared memory
//   through `ldmatrix` (x4; `.trans` for the layouts whose contiguous dimension is m or n, so all
//   four layouts NN/NT/TN/TT run the same tensor-core path), tiles are copied in with 16-byte
//   `cp.async` (LDGSTS: global → shared without passing through registers). One stage: copy,
//   wait, compute, repeat — with one block per SM (registers), nothing hides the copy latency.
//   Why faster than warptile: an HMMA does 16·8·16 = 2048 multiply-adds per warp instruction
//   (vs 32 for an FFMA), and bf16/fp16 halve the bytes per operand. Expected (H100, 4096³ bf16):
//   ~25–40% of cuBLAS (latency-bound: the block waits for its own copies every k-slice).
// - `mma_pipelined` (FE_STAGES=4): a 4-stage cp.async ring; the copy of k-slice kt+3 is issued
//   before slice kt is computed (commit/wait_group accounting), so global latency is hidden within
//   the block and the tensor cores are fed continuously; one __syncthreads per k-slice.
//   Expected: ~1.5–2.5× `mma`, ~55–70% of cuBLAS bf16/fp16 (mma.sync on Hopper tops out well
//   below wgmma's rate; the next rung is wgmma + TMA).
// tf32 (f32 inputs, Precision::Tf32): fragments are rounded with cvt.rna.tf32.f32; the f32 layouts
// whose contiguous dimension is m or n load fragments with scalar shared loads (ldmatrix .trans
// only transposes 16-bit elements), conflict-free thanks to an 8-float row pad.
// Shared layout per stage (each operand stored in its global orientation, rows padded by 16
// bytes (k-contiguous) or 8 elements (m/n-contiguous), which makes ldmatrix and the scalar
// fragment loads bank-conflict-free): A [BM][BK] or [BK][BM], B [BN][BK] or [BK][BN];
// BK = 64 bytes of k (32 halves / 16 floats). 20 KiB per stage.
// Edges and alignment: a 16-byte chunk goes through cp.async only when the operand's rows are
// 16-byte aligned (base, ld and batch stride; checked once per block) and the chunk lies inside
// the matrix; chunks fully outside are zero-filled, and partial or unaligned chunks are copied
// element by element with predicates. C is written in pairs when aligned, else element-wise.

#include "async.cuh"
#include "mma.cuh"
#ifndef FE_STAGES
#define FE_STAGES 1
#endif
// 0: f16 inputs, 1: bf16, 2: tf32 (f32 storage). Set by the host with FE_ELEM.
#ifndef FE_MMA_KIND
#define FE_MMA_KIND 0
#endif

constexpr int ES = sizeof(T);
constexpr bool TF32 = ES == 4;
constexpr int STAGES = FE_STAGES;
constexpr int BM = 128, BN = 128, NT = 256;
constexpr int BK = 64 / ES;         // k per slice: 64 bytes per row
constexpr int KSTEP = TF32 ? 8 : 16; // k of one mma
constexpr int WM = 64, WN = 32;     // warp tile
constexpr int MT = WM / 16, NTL = WN / 8;
constexpr int EPC = 16 / ES;        // elements per 16-byte chunk
constexpr int LDK = BK + EPC;       // row of a k-contiguous tile: 80 bytes
constexpr int LDMN = BM + 8;        // row of an m/n-contiguous tile: 272 B (16-bit) / 544 B (f32)
constexpr int OP_BYTES_K = BM * LDK * ES, OP_BYTES_MN = BK * LDMN * ES;
constexpr int OP_BYTES = OP_BYTES_K > OP_BYTES_MN ? OP_BYTES_K : OP_BYTES_MN;
constexpr int STAGE_BYTES = 2 * OP_BYTES;
static_assert((FE_MMA_KIND == 2) == TF32, "FE_MMA_KIND must match FE_ELEM");
static_assert(BM == BN, "one padded row length serves A and B");
static_assert(OP_BYTES % 128 == 0, "stage alignment");


// d += a·b for one 16×8 tile: m16n8k8 for tf32, m16n8k16 for the 16-bit types.
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if FE_MMA_KIND == 2
  mma_m16n8k8_tf32(d, a, b[0], b[1]);
#else
  mma_m16n8k16<FE_MMA_KIND == 1>(d, a, b[0], b[1]);
#endif
}

// Copies an R × CC tile (CC contiguous elements per row) whose element (r, c) is
// X[(gr0 + r)*ld + gc0 + c], valid when gr0 + r < rlim and gc0 + c < clim, into s (row stride LDS).
template <int R, int CC, int LDS>
__device__ __forceinline__ void copy_tile(T* s, const T* __restrict__ X, i64 ld, i64 gr0, i64 gc0,
                                          i64 rlim, i64 clim, bool fast) {
  constexpr int CPR = CC / EPC, CHUNKS = R * CPR;
  static_assert(CHUNKS % NT == 0, "whole chunks per thread");
#pragma unroll
  for (int q = 0; q < CHUNKS / NT; ++q) {
    const int e = threadIdx.x + q * NT;
    const int r = e / CPR, c = (e % CPR) * EPC;
    T* d = s + r * LDS + c;
    const i64 gr = gr0 + r, gc = gc0 + c;
    const T* src = X + gr * ld + gc;
    if (fast && gr < rlim && gc + EPC <= clim) {
      cp_async16(d, src);
    } else if (gr >= rlim || gc >= clim) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int x = 0; x < EPC; ++x) d[x] = gc + x < clim ? src[x] : from_float<T>(0.f);
    }
  }
}

struct Ctx {
  const T* A;
  const T* B;
  i64 lda, ldb, m, n, k, m0, n0;
  bool fa, fb;
};

template <bool AT, bool BT>
__device__ __forceinline__ void load_stage(char* smem, int stage, const Ctx& x, i64 k0) {
  T* sA = reinterpret_cast<T*>(smem + stage * STAGE_BYTES);
  T* sB = reinterpret_cast<T*>(smem + stage * STAGE_BYTES + OP_BYTES);
  if (AT) copy_tile<BK, BM, LDMN>(sA, x.A, x.lda, k0, x.m0, x.k, x.m, x.fa);  // [k][m]
  else    copy_tile<BM, BK, LDK>(sA, x.A, x.lda, x.m0, k0, x.m, x.k, x.fa);   // [m][k]
  if (BT) copy_tile<BN, BK, LDK>(sB, x.B, x.ldb, x.n0, k0, x.n, x.k, x.fb);   // [n][k]
  else    copy_tile<BK, BN, LDMN>(sB, x.B, x.ldb, k0, x.n0, x.k, x.n, x.fb);  // [k][n]
}

template <bool AT, bool BT>
__device__ __forceinline__ void compute_stage(const char* smem, int stage, float (&acc)[MT][NTL][4],
                                              int wm, int wn, int lane) {
  const T* sA = reinterpret_cast<const T*>(smem + stage * STAGE_BYTES);
  const T* sB = reinterpret_cast<const T*>(smem + stage * STAGE_BYTES + OP_BYTES);
  const float* fA = reinterpret_cast<const float*>(sA);
  const float* fB = reinterpret_cast<const float*>(sB);
  const int q = lane / 8, r8 = lane % 8, g = lane / 4, tq = lane % 4;
#pragma unroll
  for (int kk = 0; kk < BK; kk += KSTEP) {
    unsigned a[MT][4], b[NTL][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int mb = wm * WM + mt * 16;
      if (!AT) {
        // [m][k]: matrices (m 0-7 | 8-15) × (k lo | hi) → a0..a3.
        ldsm_x4(a[mt], sA + (mb + lane % 16) * LDK + kk + (lane / 16) * EPC);
      } else if (!TF32) {
        // [k][m], transposed on load: lanes 8q..8q+7 address k rows (q/2)*8 + r8, m cols (q%2)*8.
        ldsm_x4_t(a[mt], sA + (kk + (q / 2) * 8 + r8) * LDMN + mb + (q % 2) * 8);
      } else {
        a[mt][0] = __float_as_uint(fA[(kk + tq) * LDMN + mb + g]);
        a[mt][1] = __float_as_uint(fA[(kk + tq) * LDMN + mb + g + 8]);
        a[mt][2] = __float_as_uint(fA[(kk + tq + 4) * LDMN + mb + g]);
        a[mt][3] = __float_as_uint(fA[(kk + tq + 4) * LDMN + mb + g + 8]);
      }
    }
#pragma unroll
    for (int np = 0; np < NTL / 2; ++np) {
      const int nb = wn * WN + np * 16;
      if (BT || !TF32) {
        unsigned t4[4];
        if (BT) {
          // [n][k]: matrices (n 0-7: k lo, k hi), (n 8-15: k lo, k hi).
          ldsm_x4(t4, sB + (nb + (q / 2) * 8 + r8) * LDK + kk + (q % 2) * EPC);
        } else {
          // [k][n], transposed: (k lo, k hi) of n 0-7, then of n 8-15.
          ldsm_x4_t(t4, sB + (kk + (q % 2) * 8 + r8) * LDMN + nb + (q / 2) * 8);
        }
        b[2 * np][0] = t4[0];
        b[2 * np][1] = t4[1];
        b[2 * np + 1][0] = t4[2];
        b[2 * np + 1][1] = t4[3];
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          b[2 * np + h][0] = __float_as_uint(fB[(kk + tq) * LDMN + nb + h * 8 + g]);
          b[2 * np + h][1] = __float_as_uint(fB[(kk + tq + 4) * LDMN + nb + h * 8 + g]);
        }
      }
    }
    if (TF32) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int x = 0; x < 4; ++x) a[mt][x] = __float_as_uint(tf32_rna(__uint_as_float(a[mt][x])));
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int x = 0; x < 2; ++x) b[nt][x] = __float_as_uint(tf32_rna(__uint_as_float(b[nt][x])));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) mma(acc[mt][nt], a[mt], b[nt]);
  }
}

// Two adjacent outputs (j, j+1) of a row.
__device__ __forceinline__ void store_pair(float* c, float v0, float v1, float beta) {
  if (beta != 0.f) {
    const float2 o = *reinterpret_cast<const float2*>(c);
    v0 = fmaf(beta, o.x, v0);
    v1 = fmaf(beta, o.y, v1);
  }
  *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
}
__device__ __forceinline__ void store_pair(__half* c, float v0, float v1, float beta) {
  if (beta != 0.f) {
    const float2 o = __half22float2(*reinterpret_cast<const __half2*>(c));
    v0 = fmaf(beta, o.x, v0);
    v1 = fmaf(beta, o.y, v1);
  }
  *reinterpret_cast<__half2*>(c) = __floats2half2_rn(v0, v1);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* c, float v0, float v1, float beta) {
  if (beta != 0.f) {
    const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(c));
    v0 = fmaf(beta, o.x, v0);
    v1 = fmaf(beta, o.y, v1);
  }
  *reinterpret_cast<__nv_bfloat162*>(c) = __floats2bfloat162_rn(v0, v1);
}

static_assert(!(FE_EPI_DACT && FE_EPI_PAIRS), "the activation-backward epilogue is wgmma's");

#if FE_EPI && FE_EPI_PAIRS
// The fused epilogue of one warp's 64×32 block when all of it lies inside C (pairs aligned,
// beta == 0): rows row0 + 16mt + 8h, column pairs col0 + 8nt. No predicates, no per-element
// 64-bit index math (one row pointer per row), alpha·acc + bias as one FFMA with the bias pair
// from a register, one T2 store per pair for Y and Z; the row's residual pairs are loaded
// together before use. Z and R are uniform branches.
__device__ __forceinline__ void mma_epilogue(const float (&acc)[MT][NTL][4],
                                             const T2 (&bias2)[NTL], float alpha, const FeEpi& e,
                                             T* Cz, i64 ldc, i64 zb, i64 row0, i64 col0) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 row = row0 + mt * 16 + h * 8;
      T* crow = Cz + row * ldc + col0;
      T2 rv[NTL];
      if (e.r) {
        const T* rrow = e.r + zb * e.stride_r + row * e.ldr + col0;
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt) rv[nt] = __ldg(reinterpret_cast<const T2*>(rrow + nt * 8));
      }
      T* zrow = e.z ? e.z + zb * e.stride_z + row * e.ldz + col0 : nullptr;
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) {
        const float2 b = fe_f2(bias2[nt]);
        float v0 = fmaf(alpha, acc[mt][nt][2 * h], b.x);
        float v1 = fmaf(alpha, acc[mt][nt][2 * h + 1], b.y);
        if (zrow) fe_st2(zrow + nt * 8, v0, v1);
        v0 = fe_act(v0);
        v1 = fe_act(v1);
        if (e.r) {
          const float2 r = fe_f2(rv[nt]);
          v0 += r.x;
          v1 += r.y;
        }
        fe_st2(crow + nt * 8, v0, v1);
      }
    }
}
#endif

// -DFE_GROUPED (moe's grouped GEMM on sm_80+; the wgmma.cu header says what the modes mean):
// 1 = M-grouped (row tiles of each group, B batched by group, C without batch), 2 = K-grouped
// (C_g = op(A)_g·op(B)_g over group g's k range, any start or length: the copies predicate k
// against the group's own length). Two more parameters: `gend` (int32 cumulative ends) and
// `groups`.
#ifndef FE_GROUPED
#define FE_GROUPED 0
#endif
#if FE_GROUPED
#define FE_GROUPED_PARAMS , const int* __restrict__ gend, int groups
#define FE_GROUPED_ARGS , gend, groups
constexpr int MAX_GROUPS = 1024;
__device__ __forceinline__ int gstart(const int* gend, int g) { return g > 0 ? gend[g - 1] : 0; }
#else
#define FE_GROUPED_PARAMS
#define FE_GROUPED_ARGS
#endif

template <bool AT, bool BT>
__device__ __forceinline__ void mma_body(char* smem, const FeEpi epi, FE_MATMUL_PARAMS FE_GROUPED_PARAMS) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / (BN / WN), wn = warp % (BN / WN);
  const int g = lane / 4, tq = lane % 4;
  const bool fa = fe_aligned16(A, lda, stride_a), fb = fe_aligned16(B, ldb, stride_b);
  // Pairs of C elements need 2-element alignment of every row (j is always even).
  const bool pair_ok = ((u64)C % (2 * ES) == 0) && (ldc % 2 == 0) && (stride_c % 2 == 0);
  const i64 n0 = (i64)blockIdx.x * BN;
#if FE_GROUPED == 1
  // Inclusive prefix sums of each group's row-tile count (warp 0, 32 groups per step).
  __shared__ int cum[MAX_GROUPS];
  if (threadIdx.x < 32) {
    int carry = 0;
    for (int g0 = 0; g0 < groups; g0 += 32) {
      const int g = g0 + threadIdx.x;
      int v = g < groups ? (int)ceil_div((i64)(gend[g] - gstart(gend, g)), BM) : 0;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if ((int)threadIdx.x >= o) v += u;
      }
      if (g < groups) cum[g] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
  for (i64 rt = blockIdx.y; rt < cum[groups - 1]; rt += gridDim.y) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (cum[mid] > rt) hi = mid; else lo = mid + 1;
    }
    const i64 z = 0;
    const i64 m0 = gstart(gend, lo) + (rt - (lo > 0 ? cum[lo - 1] : 0)) * BM;
    // Rows past the group's end read as zeros and are not stored.
    const Ctx x{A, B + lo * stride_b, lda, ldb, (i64)gend[lo], n, k, m0, n0, fa, fb};
#elif FE_GROUPED == 2
  for (i64 z = blockIdx.z; z < groups; z += gridDim.z)
  for (i64 m0 = (i64)blockIdx.y * BM; m0 < m; m0 += (i64)gridDim.y * BM) {
    const i64 gs = gstart(gend, (int)z), kz = gend[z] - gs;
    const T* Az = A + gs * (AT ? lda : 1);
    const T* Bz = B + gs * (BT ? 1 : ldb);
    const Ctx x{Az, Bz, lda, ldb, m, n, kz, m0, n0, fe_aligned16(Az, lda, 0), fe_aligned16(Bz, ldb, 0)};
#else
  FE_FOR_EACH_TILE(BM) {
    const Ctx x{A + z * stride_a, B + z * stride_b, lda, ldb, m, n, k, m0, n0, fa, fb};
#endif
    const i64 nk = ceil_div(x.k, BK);
#if FE_EPI && FE_EPI_PAIRS
    // This warp's 64×32 block lies inside C: mma_epilogue runs it. Its 4 bias pairs are loaded
    // now and used after the mainloop, so their latency is hidden (4–8 registers; the
    // one-layout epilogue kernel has ~80 to spare).
    const bool fast = m0 + wm * WM + WM <= m && n0 + wn * WN + WN <= n && pair_ok && beta == 0.f &&
                      fe_pairs_aligned(epi.bias, 0, 0) &&
                      fe_pairs_aligned(epi.z, epi.ldz, epi.stride_z) &&
                      fe_pairs_aligned(epi.r, epi.ldr, epi.stride_r);
    T2 bias2[NTL];
    if (fast && epi.bias) {
      const T* bp = epi.bias + n0 + wn * WN + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) bias2[nt] = __ldg(reinterpret_cast<const T2*>(bp + nt * 8));
    } else {
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) bias2[nt] = fe_pack2<T2>(0.f, 0.f);
    }
#endif
    float acc[MT][NTL][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

    if constexpr (STAGES == 1) {
      for (i64 kt = 0; kt < nk; ++kt) {
        load_stage<AT, BT>(smem, 0, x, kt * BK);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        compute_stage<AT, BT>(smem, 0, acc, wm, wn, lane);
        __syncthreads();
      }
    } else {
      // Prologue: slices 0 .. STAGES-2 in flight, one commit group each (empty past the end, so
      // the group count stays uniform and wait_group's arithmetic holds).
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load_stage<AT, BT>(smem, s, x, (i64)s * BK);
        cp_async_commit();
      }
      int rd = 0, wr = STAGES - 1;
      for (i64 kt = 0; kt < nk; ++kt) {
        // Groups committed so far: STAGES-1+kt; leaving STAGES-2 pending means slice kt landed.
        cp_async_wait<STAGES - 2>();
        // Everyone's copies (and element-wise stores) of slice kt are visible, and everyone is
        // done computing slice kt-1, whose stage `wr` is refilled next.
        __syncthreads();
        if (kt + STAGES - 1 < nk) load_stage<AT, BT>(smem, wr, x, (kt + STAGES - 1) * BK);
        cp_async_commit();
        compute_stage<AT, BT>(smem, rd, acc, wm, wn, lane);
        rd = rd + 1 == STAGES ? 0 : rd + 1;
        wr = wr + 1 == STAGES ? 0 : wr + 1;
      }
      cp_async_wait<0>();
      __syncthreads();  // the next tile's prologue overwrites stages still being read
    }

    T* Cz = C + z * stride_c;
#if FE_EPI && FE_EPI_PAIRS
    if (fast) {
      mma_epilogue(acc, bias2, alpha, epi, Cz, ldc, z, m0 + wm * WM + g, n0 + wn * WN + 2 * tq);
      continue;
    }
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const i64 i = m0 + wm * WM + mt * 16 + g + h * 8;
        if (i >= x.m) continue;
        T* crow = Cz + i * ldc;
#if FE_EPI
        const FeEpiRow er = fe_epi_row(epi, z, i);
#endif
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt) {
          const i64 j = n0 + wn * WN + nt * 8 + 2 * tq;
          float v0 = alpha * acc[mt][nt][2 * h], v1 = alpha * acc[mt][nt][2 * h + 1];
#if FE_EPI
          // Fused epilogue: beta*C first, then bias / Z / activation / residual per element,
          // stored as a pair with beta already applied.
          if (pair_ok && j + 1 < n) {
            if (beta != 0.f) {
              v0 = fmaf(beta, to_float(crow[j]), v0);
              v1 = fmaf(beta, to_float(crow[j + 1]), v1);
            }
            store_pair(crow + j, fe_epilogue_row(er, v0, j), fe_epilogue_row(er, v1, j + 1), 0.f);
          } else {
            if (j < n) {
              if (beta != 0.f) v0 = fmaf(beta, to_float(crow[j]), v0);
              crow[j] = from_float<T>(fe_epilogue_row(er, v0, j));
            }
            if (j + 1 < n) {
              if (beta != 0.f) v1 = fmaf(beta, to_float(crow[j + 1]), v1);
              crow[j + 1] = from_float<T>(fe_epilogue_row(er, v1, j + 1));
            }
          }
#else
          if (pair_ok && j + 1 < n) {
            store_pair(crow + j, v0, v1, beta);
          } else {
            if (j < n) fe_store(crow + j, acc[mt][nt][2 * h], alpha, beta);
            if (j + 1 < n) fe_store(crow + j + 1, acc[mt][nt][2 * h + 1], alpha, beta);
          }
#endif
        }
      }
  }
}

// No register cap: capping at 128 (two blocks per SM) made NVRTC spill a few bytes even for one
// stage, so both configurations run one 8-warp block per SM (~150–245 registers).
// With -DFE_EPI the stores apply the fused epilogue (common.cuh), its parameters after the common ones.
// -DFE_A_TRANS / -DFE_B_TRANS (the `fused_pairs` epilogue kernels): one layout compiled instead
// of the four of FE_LAYOUT_DISPATCH. ptxas allocates registers over the whole kernel, and with four inlined
// bodies the 4-stage kernel sits at 238–242 registers; the epilogue's few extra live values then
// spilled 8–1200 bytes (which is why the `fused` epilogue kernels run at 2 stages). One body:
// 155–175 registers at 4 stages, no spills. The host compiles the module of the problem's layout.
extern "C" __global__ void __launch_bounds__(NT) matmul_mma(FE_MATMUL_PARAMS FE_EPI_PARAMS FE_GROUPED_PARAMS) {
  // The tile code assumes exactly NT threads: a host/kernel mismatch must fail loudly.
  if (blockDim.x * blockDim.y * blockDim.z != NT) __trap();
  extern __shared__ __align__(128) char smem[];
  const FeEpi epi = FE_EPI_MAKE;
#if defined(FE_A_TRANS) && defined(FE_B_TRANS)
  if ((a_trans != 0) != (FE_A_TRANS != 0) || (b_trans != 0) != (FE_B_TRANS != 0)) __trap();
  mma_body<FE_A_TRANS != 0, FE_B_TRANS != 0>(smem, epi, FE_MATMUL_ARGS FE_GROUPED_ARGS);
#else
  FE_LAYOUT_DISPATCH(mma_body, smem, epi, );
#endif
}
