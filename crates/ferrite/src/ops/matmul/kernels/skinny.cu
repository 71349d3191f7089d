// matmul/skinny — the decode rung: C = op(A)·op(B) for a short A (m ≤ 64 rows: a decode step,
// a few sequences) with both operands K-contiguous — A row-major, B transposed (linear's weight
// W [n, k] is exactly that B). bf16/f16 in, fp32 accumulate.
//
// Why another kernel: at m ≤ 64 the GEMM is a read of B (the weight) and little else — 2·m FLOPs
// per weight element — so its time is B's bytes over the DRAM bandwidth. The tiled kernels cut C
// into 128-row tiles: at m = 1 a tile is 1/128 useful, and n / 256 tiles leave most SMs idle
// (4096 columns: 16 tiles on 132 SMs), so they reach a fraction of the bandwidth.
//
// How this one streams B once with every SM busy (measured 1.6–3.0 TB/s of B on the H100,
// 0.80–1.05× cuBLAS at m = 1 and 8: docs/matmul.md):
// - A warp owns 16 columns of C (16 rows of B) and a slice of k, walked in passes of 32·U k
//   (U chunks of 32). Each lane takes 16 bytes (8 elements) of two B rows per chunk: 4 lanes
//   cover 64 contiguous bytes of a row, a warp 8 rows.
// - sm_90: B moves by the tensor memory accelerator into a per-warp ring of STAGES passes in
//   shared memory (one 16-row box per pass from the host's tensor map over B, counted in bytes
//   on the stage's mbarrier), and the lanes read their 16-byte pieces from there. Copies in
//   flight cost no registers and no load slots, so each warp keeps up to 3 passes (24 KiB) on
//   their way. The register path below (U 16-byte loads per row in flight per lane, then the
//   math) is what sm_80 runs, and B rows that are not 16-byte aligned (no tensor map).
// - The dot products run on the tensor cores with B as the MMA's A operand ("swap AB"): D (16
//   columns of C × 8 rows of A) += B(16 × 16 k) · A(16 k × 8 rows), mma.sync m16n8k16, one per
//   8 rows of A (MT = ceil(m / 8) tiles). A k-sum may take its terms in any order as long as both
//   operands agree, so each lane's 8 contiguous elements are the k positions its fragments
//   expect: words 0 and 1 of its 16 bytes are fragment registers a[0]/a[2] (B row g) and b0/b1
//   (A row g) of the first MMA, words 2 and 3 those of the second — no shuffles, no ldmatrix.
//   At m = 64 that is 16 FLOPs per byte of B, far under the tensor cores' rate, where CUDA-core
//   FMAs (8 per element per row of A) would not keep up with the bandwidth above m ≈ 8.
// - A (m × k, small: L1/L2 resident) is read with plain cached 16-byte loads, once per chunk;
//   with 1–2 tiles a whole pass of them is loaded before the pass's B (a load per chunk in
//   front of its MMAs put A's load latency on the critical path U times per pass: 8 rows of A
//   ran at half the speed of one, whose other rows are not loaded).
// - Split k: blockDim = (32, S, 8 / S): S warps share a column group, each taking every S-th
//   group of U chunks; the host picks S ∈ {1, 2, 4, 8} so that about 16 warps per SM run (4096
//   columns: 256 groups × 8 slices). The partial sums meet in shared memory and the slice-0 warp
//   adds them in slice order (deterministic), then stores α·acc + β·C through the epilogue hook
//   (bias, Z, activation, residual with -DFE_EPI, as the other rungs).
// - Rows that are not 16-byte aligned (base, ld, batch stride) and a k tail inside a 16-byte
//   chunk are read element by element with zeros past k; rows past m or n read as zeros.
#include "hopper.cuh"
#include "mma.cuh"

constexpr bool SKINNY_BF16 = IsBf16<T>::value;
constexpr int CHUNK = 32;   // k per 16-byte load of 4 lanes
constexpr int WARPS = 8;    // per block: S k-slices × 8/S column groups
constexpr int GROUP_N = 16; // columns of C per warp (the MMA's 16 rows)

// 8 elements of row `row` at k index kk, as four 32-bit words (two elements each); zeros past k
// or for a missing row. `stream`: read B without allocating in L1.
template <bool STREAM>
__device__ __forceinline__ uint4 load8(const T* row, i64 kk, i64 k, bool vec) {
  uint4 r = make_uint4(0, 0, 0, 0);
  if (row == nullptr || kk >= k) return r;
  if (vec && kk + 8 <= k) {
    const uint4* p = reinterpret_cast<const uint4*>(row + kk);
    if (STREAM) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                   : "l"(p));
    } else {
      r = __ldg(p);
    }
    return r;
  }
  const unsigned short* h = reinterpret_cast<const unsigned short*>(row + kk);
  unsigned w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const unsigned lo = kk + 2 * j < k ? h[2 * j] : 0u;
    const unsigned hi = kk + 2 * j + 1 < k ? h[2 * j + 1] : 0u;
    w[j] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Chunks of 32 k per pass: 8 (16 rows × 512 bytes = 8 KiB of B per warp), 4 at MT = 8, where
// A's fragments take the registers.
template <int MT> struct Pass {
  static constexpr int U = MT >= 8 ? 4 : 8;
  static constexpr int K = CHUNK * U;  // k per pass
  // sm_90 ring (per warp): a stage is one TMA box of the pass's 16 B rows, K elements each,
  // dense (512 or 256 bytes a row).
  static constexpr int ROW = K * (int)sizeof(T);
  static constexpr int STAGE = GROUP_N * ROW;
  static constexpr int STAGES = U >= 8 ? 3 : 4;
  // + the mbarriers, + 128 bytes to align the ring.
  static constexpr int RING = WARPS * STAGES * STAGE + WARPS * STAGES * 8 + 128;
  static constexpr int RED = WARPS * MT * 4 * 32 * (int)sizeof(float);
};

template <int MT>
__device__ __forceinline__ void skinny_body(const FeEpi epi, const TmaDesc& tma_b,
                                            FE_MATMUL_PARAMS) {
  typedef Pass<MT> P;
  constexpr int U = P::U;
  extern __shared__ __align__(128) unsigned char skinny_smem[];
  float* red = reinterpret_cast<float*>(skinny_smem);  // [WARPS][MT·4][32], after the k loop
  const int lane = threadIdx.x, g = lane / 4, q = lane % 4;
  const int S = blockDim.y, ks = threadIdx.y, warp = threadIdx.z * S + ks;
  const bool vec = fe_aligned16(A, lda, stride_a) && fe_aligned16(B, ldb, stride_b);
  const i64 n0 = ((i64)blockIdx.x * blockDim.z + threadIdx.z) * GROUP_N;
  // B rows this warp reads (past n: none).
  const int nrows = (int)max((i64)0, min((i64)GROUP_N, n - n0));
#if __CUDA_ARCH__ >= 900
  // sm_90: passes of B arrive by TMA (one 16-row box per pass, the host's tensor map over B)
  // in a per-warp ring of shared memory; the lanes read their 16-byte pieces from there. A copy
  // in flight costs no registers and no load slots, so each warp keeps STAGES passes (24 KiB)
  // on their way; one box per pass (not one copy per row) because the copy unit's cost is per
  // operation. Rows past n and k past the end arrive as zeros. B rows that are not 16-byte
  // aligned (no tensor map) take the register path.
  const bool tma = fe_aligned16(B, ldb, stride_b);
  const unsigned raw = smem_u32(skinny_smem), base = (raw + 127) & ~127u;
  if (dynamic_smem_bytes() < (unsigned)max(P::RING, P::RED)) __trap();
  const unsigned ring = base + warp * P::STAGES * P::STAGE;
  const unsigned bars = base + WARPS * P::STAGES * P::STAGE + warp * P::STAGES * 8;
  if (lane == 0) {
    for (int s = 0; s < P::STAGES; ++s) mbar_init(bars + 8 * s, 1);
    fence_mbarrier_init();
    prefetch_tensormap(&tma_b);
  }
  __syncwarp();
  unsigned used = 0;  // passes this warp took from its ring (all batches): stage and parity
#else
  if (dynamic_smem_bytes() < (unsigned)P::RED) __trap();
#endif
  for (i64 z = blockIdx.z; z < batch; z += gridDim.z) {
    const T* Az = A + z * stride_a;
    const T* Bz = B + z * stride_b;
    const T* b0 = g < nrows ? Bz + (n0 + g) * ldb : nullptr;
    const T* b1 = g + 8 < nrows ? Bz + (n0 + g + 8) * ldb : nullptr;
    const T* arow[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) arow[t] = 8 * t + g < m ? Az + (8 * t + g) * lda : nullptr;
    float acc[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    const i64 k0 = (i64)ks * P::K, kstep = (i64)S * P::K;
#if __CUDA_ARCH__ >= 900
    const i64 passes = tma && nrows > 0 && k > k0 ? (k - k0 - 1) / kstep + 1 : 0;
    const int zb = stride_b ? (int)z : 0;
    auto issue = [&](i64 p) {
      if (lane == 0) {
        const unsigned s = (unsigned)((used + p) % P::STAGES);
        mbar_expect_tx(bars + 8 * s, P::STAGE);
        tma_load(ring + s * P::STAGE, &tma_b, bars + 8 * s, (int)(k0 + p * kstep), (int)n0, zb);
      }
    };
    for (i64 p = 0; p < min(passes, (i64)P::STAGES); ++p) issue(p);
#else
    const i64 passes = 0;
#endif
    i64 p = 0;
    for (i64 kc = k0; kc < k; kc += kstep, ++p) {
      // A's pieces of the pass first (1–2 tiles): their loads are in flight while the stage
      // lands, instead of one load latency per chunk in front of its MMAs.
      constexpr int XP = MT <= 2 ? U * MT : 1;
      uint4 xs[XP];
      if constexpr (MT <= 2) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int t = 0; t < MT; ++t)
            xs[u * MT + t] = load8<false>(arow[t], kc + u * CHUNK + 8 * q, k, vec);
      }
      uint4 w0[U], w1[U];
      if (p < passes) {
#if __CUDA_ARCH__ >= 900
        const unsigned s = (unsigned)((used + p) % P::STAGES);
        mbar_wait(bars + 8 * s, (unsigned)(((used + p) / P::STAGES) & 1));
        const unsigned r0 = ring + s * P::STAGE + g * P::ROW + 16 * q;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(w0[u].x), "=r"(w0[u].y), "=r"(w0[u].z), "=r"(w0[u].w)
                       : "r"(r0 + 64 * u));
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(w1[u].x), "=r"(w1[u].y), "=r"(w1[u].z), "=r"(w1[u].w)
                       : "r"(r0 + 8 * P::ROW + 64 * u));
        }
        // The stage is in registers: refill it with the pass STAGES ahead.
        __syncwarp();
        if (p + P::STAGES < passes) issue(p + P::STAGES);
#endif
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 kk = kc + u * CHUNK + 8 * q;
          w0[u] = load8<true>(b0, kk, k, vec);
          w1[u] = load8<true>(b1, kk, k, vec);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 kk = kc + u * CHUNK + 8 * q;
        const unsigned fa[4] = {w0[u].x, w1[u].x, w0[u].y, w1[u].y};
        const unsigned fb[4] = {w0[u].z, w1[u].z, w0[u].w, w1[u].w};
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4 x = MT <= 2 ? xs[(u * MT + t) % XP] : load8<false>(arow[t], kk, k, vec);
          mma_m16n8k16<SKINNY_BF16>(acc[t], fa, x.x, x.y);
          mma_m16n8k16<SKINNY_BF16>(acc[t], fb, x.z, x.w);
        }
      }
    }
#if __CUDA_ARCH__ >= 900
    used += (unsigned)passes;
#endif
    if (S > 1) {
      __syncthreads();  // red overlays the other warps' rings
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[(warp * MT * 4 + t * 4 + i) * 32 + lane] = acc[t][i];
      __syncthreads();
      if (ks == 0) {
        for (int s = 1; s < S; ++s)
#pragma unroll
          for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][i] += red[((warp + s) * MT * 4 + t * 4 + i) * 32 + lane];
      }
      __syncthreads();  // red (and the rings under it) is reused by the next batch
    }
    if (ks == 0) {
      // D(col g (+8), row 2q (+1)) of tile t: C row 8t + 2q + (i & 1), column n0 + g + 8·(i >> 1).
      T* Cz = C + z * stride_c;
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const i64 row = 8 * t + 2 * q + (i & 1), col = n0 + g + 8 * (i >> 1);
          if (row < m && col < n)
            fe_store_epi(Cz + row * ldc + col, acc[t][i], alpha, beta, epi, z, row, col);
        }
    }
  }
}

// One entry point per tile count; the host launches the smallest MT with 8·MT ≥ m and checks
// the layout (A row-major, B transposed) and m ≤ 64. Registers are sized for one block per SM
// (on sm_90 the rings take most of its shared memory; capped for two, the kernels spill).
#define SKINNY_ENTRY(MT_)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1) matmul_skinny##MT_( \
      FE_MATMUL_PARAMS, const __grid_constant__ TmaDesc tma_b FE_EPI_PARAMS) {       \
    if (a_trans || !b_trans || m > 8 * MT_) __trap();                                      \
    skinny_body<MT_>(FE_EPI_MAKE, tma_b, FE_MATMUL_ARGS);                                         \
  }
SKINNY_ENTRY(1)
SKINNY_ENTRY(2)
SKINNY_ENTRY(4)
SKINNY_ENTRY(8)
