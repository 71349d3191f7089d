// matmul/warptile — step 7 of the CUDA ladder (fp32 SIMT): warp tiling, double-buffered shared
// memory and register prefetch, at two blocks per SM.
//
// Changes vs vectorized (still 128×128×8 per block, 256 threads, 8×8 outputs per thread):
// - Warp tiling: the 8 warps split the block tile into 4×2 warp tiles of 32×64, and a warp walks
//   its tile as 2×2 sub-tiles of 16×32 in which lane (lm, ln) of a 4×8 grid owns a 4×4 block.
//   A warp's k-step then reads only 4 distinct A float4s and 8 distinct B float4s from shared
//   memory (vectorized: 16 and 32 — lanes of one warp spanned the whole block tile), so the
//   loads are mostly broadcasts: fewer shared-memory wavefronts per FMA, and a warp works on a
//   compact region — the shape the tensor-core kernels use next (warp tile → mma fragments).
// - Copies without registers: each k-slice goes global → shared with `cp.async` (sm_80+) into a
//   ring of W_STAGES (3) buffers, issued two slices ahead of the one computed, so DRAM/L2 latency
//   hides behind two slices of FMAs and the copy holds no registers (vectorized stages every
//   vector through registers and stalls the block between its two barriers). One barrier per
//   slice: a buffer is refilled only after the barrier that follows its last read. Vectors whose
//   destination is contiguous (A stored m-contiguous, B n-contiguous) are one 16-byte copy when
//   the operand is 16-byte aligned; the transposing ones (A row-major into sA[p][i], B transposed
//   into sB[p][j]) and every edge or unaligned vector are four 4-byte copies, each zero-filled
//   past the matrix (src-size 0), so every shape and layout stays correct with no predicated
//   shared-memory stores.
// - `__launch_bounds__(256, 2)`: with no prefetch registers, 64 accumulators + fragments fit in
//   128 registers and two blocks share an SM (one block's barrier wait is the other's issue slots).
// History: the first warptile (2026-11-22) used k-slices of 16, one shared buffer (two barriers
// per slice) and a register prefetch of the next slice: 179 registers, one block per SM, 34.7
// TFLOP/s = 0.67× cuBLAS fp32, slower than vectorized (0.74×); capped at 128 registers it
// spilled, and so did a double-buffered k-slice-8 version with the register prefetch (24–340
// bytes of spill stores under ptxas 13.0). The cp.async ring removes the prefetch registers.
// Expected effect (H100, 4096³ f32 NN): ~1.1–1.2× vectorized, 0.80–0.88× cuBLAS fp32 (the
// issue's target is ≥ 0.8×).

constexpr int W_BM = 256, W_BN = 128, W_BK = 8, W_NT = 256;
constexpr int W_WM = 64, W_WN = 64;      // warp tile (warps 4 × 2)
constexpr int W_SM = 16, W_SN = 32;      // sub-tile strides: 4 × 2 sub-tiles per lane
constexpr int W_MS = W_WM / W_SM, W_NS = W_WN / W_SN;
constexpr int W_TM = 4, W_TN = 4;        // per-lane block in a sub-tile: lanes 4 (rows) × 8 (cols)
constexpr int W_LDA = W_BM + 4;          // padded row of sA[p][i] (a multiple of 4 floats)
constexpr int W_LDB = W_BN + 4;          // padded row of sB[p][j]
constexpr int W_STAGES = 3;              // cp.async ring depth (k-slices in shared memory)
constexpr int W_BUFA = W_BK * W_LDA, W_BUFB = W_BK * W_LDB;  // floats per operand per stage

__device__ __forceinline__ unsigned w_smem(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// 4 bytes global → shared; src_bytes 0 writes a zero (the source is not read).
__device__ __forceinline__ void w_cp4(float* s, const float* g, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(w_smem(s)), "l"(g), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void w_cp16(float* s, const float* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(w_smem(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void w_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void w_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One thread's share of one operand's k-slice: a vector of 4 elements along the stored operand's
// contiguous dimension, copied to shared memory at `dst` with `step` floats between its elements
// (1: contiguous there too). `line` is the vector's coordinate across it, `first` its first
// element's along it; the one of the two that is a k coordinate is relative to the slice.
template <int STEP>
struct WCopy {
  const float* src;  // element 0 for the slice at k0 = 0
  i64 kstride;       // elements between consecutive k in the stored operand
  int dst;           // shared offset of element 0 within a stage (STEP: between elements)
  bool along_k;      // the vector runs along k (else along m or n, and its line is a k)
  i64 line, first;   // at k0 = 0
  i64 lines, len;    // extents across and along the vector

  // Copies the vector of the slice starting at k0 into `stage`; parts outside the matrix are
  // zero-filled without reading.
  __device__ __forceinline__ void issue(float* stage, i64 k0, bool fast) const {
    const float* g = src + k0 * kstride;
    const i64 ln = along_k ? line : line + k0, f = along_k ? first + k0 : first;
    float* d = stage + dst;
    const bool line_ok = ln < lines;
    if (STEP == 1 && fast && line_ok && f + 3 < len) {
      w_cp16(d, g);
      return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = line_ok && f + e < len;
      w_cp4(d + e * STEP, ok ? g + e : src, ok ? 4 : 0);
    }
  }

  // The same copy for a slice known to lie inside the matrix with the operand 16-byte aligned
  // (an interior tile, k0 + W_BK ≤ k): no predicates, no zero-fill.
  __device__ __forceinline__ void issue_inside(float* stage, i64 k0) const {
    const float* g = src + k0 * kstride;
    float* d = stage + dst;
    if (STEP == 1) {
      w_cp16(d, g);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) w_cp4(d + e * STEP, g + e, 4);
    }
  }
};

// Thread threadIdx.x's q-th vector of an R × CN tile of op(X) at (r0, c0) (X stored transposed
// when TR; R·CN / (4·W_NT) vectors per thread), stored in shared memory as s[r·SR + c·SC]. K_IS_COLS: k is op(X)'s
// column dimension (A: m × k) rather than its row dimension (B: k × n); pass 0 for the k offset.
template <int R, int CN, bool TR, int SR, int SC, bool K_IS_COLS>
__device__ __forceinline__ WCopy<TR ? SR : SC> w_copy(const float* X, i64 ld, i64 r0, i64 c0, i64 rows,
                                                      i64 cols, int q) {
  static_assert((R * CN) % (4 * W_NT) == 0, "whole vectors per thread");
  const int e = threadIdx.x + q * W_NT;  // the thread's q-th vector
  const int vr = TR ? (e % (R / 4)) * 4 : e / (CN / 4);
  const int vc = TR ? e / (R / 4) : (e % (CN / 4)) * 4;
  const i64 gr = r0 + vr, gc = c0 + vc;
  WCopy<TR ? SR : SC> w;
  w.src = X + (TR ? gc * ld + gr : gr * ld + gc);
  // Stored element (r, c) of op(X) lies at TR ? c·ld + r : r·ld + c.
  w.kstride = K_IS_COLS ? (TR ? ld : 1) : (TR ? 1 : ld);
  w.dst = vr * SR + vc * SC;
  w.along_k = K_IS_COLS != TR;
  w.line = TR ? gc : gr;
  w.first = TR ? gr : gc;
  w.lines = TR ? cols : rows;
  w.len = TR ? rows : cols;
  return w;
}

template <bool AT, bool BT>
__device__ __forceinline__ void warptile_body(float* sA, float* sB, FE_MATMUL_PARAMS) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / (W_BN / W_WN), wn = warp % (W_BN / W_WN);
  const int lm = lane / 8, ln = lane % 8;
  const int arow = wm * W_WM + lm * W_TM;  // + s*W_SM: first row of this lane's A values
  const int bcol = wn * W_WN + ln * W_TN;  // + s*W_SN: first column of its B values
  const i64 n0 = (i64)blockIdx.x * W_BN;
  const bool fa = fe_aligned16(A, lda, stride_a);
  const bool fb = fe_aligned16(B, ldb, stride_b);
  const bool fc = fe_aligned16(C, ldc, stride_c);
  const int nk = (int)((k + W_BK - 1) / W_BK);
  FE_FOR_EACH_TILE(W_BM) {
    // sA[p][i] (op(A) element (i, p) at p·W_LDA + i), sB[p][j]; A is two vectors per thread.
    const float* Az = A + z * stride_a;
    const auto ca0 = w_copy<W_BM, W_BK, AT, 1, W_LDA, true>(Az, lda, m0, 0, m, k, 0);
    const auto ca1 = w_copy<W_BM, W_BK, AT, 1, W_LDA, true>(Az, lda, m0, 0, m, k, 1);
    const auto cb = w_copy<W_BK, W_BN, BT, W_LDB, 1, false>(B + z * stride_b, ldb, 0, n0, k, n, 0);
    // Interior tiles of aligned operands copy every slice but a partial last one without
    // predicates (the general path costs ~150 instructions per slice).
    const bool inside = fa && fb && m0 + W_BM <= m && n0 + W_BN <= n;
    const i64 k_inside = inside ? k / W_BK * W_BK : 0;  // slices starting below this are whole
    auto issue = [&](int stage, i64 k0) {
      float* a = sA + stage * W_BUFA;
      float* b = sB + stage * W_BUFB;
      if (k0 < k_inside) {
        ca0.issue_inside(a, k0);
        ca1.issue_inside(a, k0);
        cb.issue_inside(b, k0);
      } else {
        ca0.issue(a, k0, fa);
        ca1.issue(a, k0, fa);
        cb.issue(b, k0, fb);
      }
    };
    float acc[W_MS][W_NS][W_TM][W_TN] = {};
    // Prologue: slices 0 .. W_STAGES-2 in flight (one commit group per slice, empty past k). The
    // previous tile's last reads of these buffers are behind the barrier ending its loop.
#pragma unroll
    for (int s = 0; s < W_STAGES - 1; ++s) {
      if (s < nk) issue(s, (i64)s * W_BK);
      w_commit();
    }
    for (int t = 0; t < nk; ++t) {
      w_wait<W_STAGES - 2>();  // slice t has landed (for this thread's copies) ...
      __syncthreads();         // ... and for everyone's; slice t-1's buffer is read by no one
      {
        const int f = t + W_STAGES - 1;
        if (f < nk) issue(f % W_STAGES, (i64)f * W_BK);
        w_commit();
      }
      const float* a_s = sA + (t % W_STAGES) * W_BUFA;
      const float* b_s = sB + (t % W_STAGES) * W_BUFB;
#pragma unroll
      for (int p = 0; p < W_BK; ++p) {
        float4 a[W_MS], b[W_NS];
#pragma unroll
        for (int s = 0; s < W_MS; ++s)
          a[s] = *reinterpret_cast<const float4*>(a_s + p * W_LDA + arow + s * W_SM);
#pragma unroll
        for (int s = 0; s < W_NS; ++s)
          b[s] = *reinterpret_cast<const float4*>(b_s + p * W_LDB + bcol + s * W_SN);
#pragma unroll
        for (int sm = 0; sm < W_MS; ++sm) {
          const float av[4] = {a[sm].x, a[sm].y, a[sm].z, a[sm].w};
#pragma unroll
          for (int sn = 0; sn < W_NS; ++sn) {
            const float bv[4] = {b[sn].x, b[sn].y, b[sn].z, b[sn].w};
#pragma unroll
            for (int r = 0; r < W_TM; ++r)
#pragma unroll
              for (int c = 0; c < W_TN; ++c)
                acc[sm][sn][r][c] = fmaf(av[r], bv[c], acc[sm][sn][r][c]);
          }
        }
      }
    }
    w_wait<0>();      // nothing of this tile left in flight (the empty tail groups)
    __syncthreads();  // every read of the ring done before the next tile's prologue refills it
#pragma unroll
    for (int sm = 0; sm < W_MS; ++sm)
#pragma unroll
      for (int r = 0; r < W_TM; ++r) {
        const i64 i = m0 + arow + sm * W_SM + r;
        if (i >= m) continue;
        float* crow = C + z * stride_c + i * ldc;
#pragma unroll
        for (int sn = 0; sn < W_NS; ++sn) {
          const i64 j = n0 + bcol + sn * W_SN;
          const float4 v = make_float4(acc[sm][sn][r][0], acc[sm][sn][r][1], acc[sm][sn][r][2],
                                       acc[sm][sn][r][3]);
          fe_store4(crow + j, j, n, v, alpha, beta, fc);
        }
      }
  }
}

// One block per SM (128 accumulators per thread, as cuBLAS's own SGEMM: ~255 registers).
extern "C" __global__ void __launch_bounds__(W_NT, 1) matmul_warptile(FE_MATMUL_PARAMS) {
  // The tile code assumes exactly W_NT threads: a host/kernel mismatch must fail loudly.
  if (blockDim.x * blockDim.y * blockDim.z != W_NT) __trap();
  __shared__ __align__(16) float sA[W_STAGES * W_BUFA], sB[W_STAGES * W_BUFB];
  FE_LAYOUT_DISPATCH(warptile_body, sA, sB, );
}
