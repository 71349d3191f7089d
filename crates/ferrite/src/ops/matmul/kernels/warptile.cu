// matmul/warptile — step 7 of the CUDA ladder (fp32 SIMT): cuBLAS's own SGEMM shape — warp
// tiles, a cp.async ring, 128 accumulators per thread, one block per SM.
//
// Changes vs vectorized (128×128×8 per block, 8×8 outputs per thread, two blocks per SM):
// - Block tile 256×128, 8 warps of 64×64 (4 × 2), 16×8 outputs per lane as 4×2 sub-tiles of
//   4×4: lane (lm, ln) of a 4×8 grid owns rows lm·4 + 16·s and columns ln·4 + 32·s. A k-step
//   is 4 A and 2 B 16-byte shared loads for 128 FMAs, and a warp's loads are mostly broadcasts
//   (4 distinct A vectors, 8 distinct B vectors): shared wavefronts equal the ideal (measured).
//   Instruction-level parallelism (128 independent accumulators) stands in for occupancy.
// - Copies without registers: each k-slice goes global → shared with `cp.async` into a ring of
//   W_STAGES buffers, issued W_STAGES − 1 slices ahead, one barrier per slice.
// - k-slices of 16 (was 8): half the barriers and ring waits per FMA. Measured +6 % at 4096³
//   (38.5 → 40.9 TFLOP/s), the static ring at 3 × 25 KiB.
// - Transposing copies (A stored row-major, k contiguous, into sA[k][i]; B stored transposed
//   into sB[k][j]) are 4-byte cp.async arranged so that one warp instruction covers 4 lines × 8
//   consecutive k: 4 global sectors and, with the padded rows (≡ 4 mod 32 floats), 32 distinct
//   banks. The earlier map (each thread a 4-vector along k) touched 16 sectors per instruction:
//   Nsight Compute counted 2.9e8 L1 wavefronts for these copies against an ideal 2.5e7 — more
//   than all the fragment loads together — and the ring's wait was the top stall (8 %). With
//   both changes: 41.8 TFLOP/s = 0.81× cuBLAS fp32 at 4096³, 0.82× at 8192³ (docs/matmul.md).
// Earlier versions: the first warptile (128×128×16, one buffer, register prefetch, 179
// registers) measured 0.67× cuBLAS fp32, slower than vectorized (0.74×); a 128×128×8 cp.async
// version at two blocks per SM 0.68×; this shape with 8-deep slices 0.75×. See docs/matmul.md.

#include "async.cuh"

constexpr int W_BM = 256, W_BN = 128, W_BK = 16, W_NT = 256;
constexpr int W_WM = 64, W_WN = 64;      // warp tile (warps 4 × 2)
constexpr int W_SM = 16, W_SN = 32;      // sub-tile strides: 4 × 2 sub-tiles per lane
constexpr int W_MS = W_WM / W_SM, W_NS = W_WN / W_SN;
constexpr int W_TM = 4, W_TN = 4;        // per-lane block in a sub-tile: lanes 4 (rows) × 8 (cols)
constexpr int W_LDA = W_BM + 4;          // padded row of sA[p][i] (a multiple of 4 floats)
constexpr int W_LDB = W_BN + 4;          // padded row of sB[p][j]
#ifndef FE_W_STAGES
#define FE_W_STAGES 3
#endif
constexpr int W_STAGES = FE_W_STAGES;    // cp.async ring depth (k-slices in shared memory)
constexpr int W_BUFA = W_BK * W_LDA, W_BUFB = W_BK * W_LDB;  // floats per operand per stage

// One thread's share of a contiguous operand's k-slice (A stored transposed, B row-major: the
// stored rows run along m or n, as the shared rows do): a vector of 4 elements, one 16-byte
// copy when it lies in the matrix and the operand is aligned, else four 4-byte copies with the
// parts outside zero-filled. `line` is the vector's k (relative to the slice), `first` its
// first element's m or n.
struct WCopy {
  const float* src;  // element 0 for the slice at k0 = 0
  i64 kstride;       // elements between consecutive k in the stored operand
  int dst;           // shared offset of element 0 within a stage
  i64 line, first;   // at k0 = 0
  i64 lines, len;    // extents: k, and m or n

  // Copies the vector of the slice starting at k0 into `stage`.
  __device__ __forceinline__ void issue(float* stage, i64 k0, bool fast) const {
    const float* g = src + k0 * kstride;
    float* d = stage + dst;
    const bool line_ok = line + k0 < lines;
    if (fast && line_ok && first + 3 < len) {
      cp_async16(d, g);
      return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = line_ok && first + e < len;
      cp_async4(d + e, ok ? g + e : src, ok ? 4 : 0);
    }
  }

  // The same copy for a slice known to lie inside the matrix with the operand 16-byte aligned
  // (an interior tile, k0 + W_BK ≤ k): no predicates, no zero-fill.
  __device__ __forceinline__ void issue_inside(float* stage, i64 k0) const {
    cp_async16(stage + dst, src + k0 * kstride);
  }
};

// The transposing copy of one operand's k-slice: the operand is stored with k contiguous (A
// row-major, B transposed) and goes to shared memory k-major, s[kc·LD + line]. Chunk q of a
// thread is one 4-byte element; warp w's instruction q covers lines 4·(8·(q % QL) + w) .. +3
// and k 8·(q / QL) .. +7 (lane / 8 the line, lane % 8 the k), so it reads 4 whole 32-byte
// sectors and writes 32 distinct banks (LD ≡ 4 mod 32).
template <int L, int LD>
struct TCopy {
  static constexpr int QL = L / 32;            // 32-line groups of the tile
  static constexpr int EPT = L * W_BK / W_NT;  // elements per thread per slice
  static_assert(L % 32 == 0 && W_BK % 8 == 0 && EPT == QL * (W_BK / 8), "whole chunks");
  static_assert(LD % 32 == 4, "a warp's 4 lines × 8 k land in distinct banks");
  const float* src;  // this thread's element of chunk 0 at k0 = 0
  i64 ld;            // elements between consecutive lines
  int dst;           // its shared offset within a stage
  i64 line, lines;   // its line (chunk 0) and the matrix's line count
  int kc;            // its k within the slice (chunk 0)
  i64 k;             // the matrix's k extent

  __device__ __forceinline__ TCopy(const float* X, i64 ld_, i64 line0, i64 lines_, i64 k_) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int l = warp * 4 + lane / 8;
    kc = lane % 8;
    ld = ld_;
    line = line0 + l;
    lines = lines_;
    k = k_;
    src = X + line * ld + kc;
    dst = kc * LD + l;
  }
  // Copies the slice starting at k0 into `stage`; elements outside the matrix are zero-filled
  // without reading. `inside`: the whole slice lies in the matrix (no predicates).
  __device__ __forceinline__ void issue(float* stage, i64 k0, bool inside) const {
#pragma unroll
    for (int q = 0; q < EPT; ++q) {
      const int lq = (q % QL) * 32, kq = (q / QL) * 8;
      const float* g = src + lq * ld + kq + k0;
      float* d = stage + dst + kq * LD + lq;
      if (inside) {
        cp_async4(d, g, 4);
      } else {
        const bool ok = line + lq < lines && kc + kq + k0 < k;
        cp_async4(d, ok ? g : src, ok ? 4 : 0);
      }
    }
  }
};

// Thread threadIdx.x's q-th vector of a contiguous R × CN tile of op(X) at (r0, c0) (R·CN /
// (4·W_NT) vectors per thread), stored in shared memory as s[r·SR + c·SC] with the vector's
// elements adjacent there. K_IS_COLS: k is op(X)'s column dimension (A, stored transposed: X is
// k × m) rather than its row dimension (B, row-major: k × n); the k offset is 0 (the slice's).
template <int R, int CN, int SR, int SC, bool K_IS_COLS>
__device__ __forceinline__ WCopy w_copy(const float* X, i64 ld, i64 r0, i64 c0, i64 rows, i64 cols,
                                        int q) {
  static_assert((R * CN) % (4 * W_NT) == 0, "whole vectors per thread");
  const int e = threadIdx.x + q * W_NT;  // the thread's q-th vector
  // A (K_IS_COLS, stored transposed): vectors run along op(A)'s rows; B: along its columns.
  const int vr = K_IS_COLS ? (e % (R / 4)) * 4 : e / (CN / 4);
  const int vc = K_IS_COLS ? e / (R / 4) : (e % (CN / 4)) * 4;
  const i64 gr = r0 + vr, gc = c0 + vc;
  WCopy w;
  // Stored element (r, c) of op(X) lies at c·ld + r (A transposed) or r·ld + c (B).
  w.src = X + (K_IS_COLS ? gc * ld + gr : gr * ld + gc);
  w.kstride = ld;  // both are k-major in memory
  w.dst = vr * SR + vc * SC;
  w.line = K_IS_COLS ? gc : gr;
  w.first = K_IS_COLS ? gr : gc;
  w.lines = K_IS_COLS ? cols : rows;
  w.len = K_IS_COLS ? rows : cols;
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
    const float* Bz = B + z * stride_b;
    // Contiguous operands (A stored transposed, B row-major) go as 16-byte vectors; the others
    // through the transposing 4-byte map (TCopy). Unused copies are never issued.
    constexpr int AV = W_BM * W_BK / (4 * W_NT), BV = W_BK * W_BN / (4 * W_NT);
    WCopy ca[AT ? AV : 1], cb[BT ? 1 : BV];
    if constexpr (AT) {
#pragma unroll
      for (int q = 0; q < AV; ++q) ca[q] = w_copy<W_BM, W_BK, 1, W_LDA, true>(Az, lda, m0, 0, m, k, q);
    }
    if constexpr (!BT) {
#pragma unroll
      for (int q = 0; q < BV; ++q) cb[q] = w_copy<W_BK, W_BN, W_LDB, 1, false>(Bz, ldb, 0, n0, k, n, q);
    }
    const TCopy<W_BM, W_LDA> ta(Az, lda, m0, AT ? 0 : m, k);
    const TCopy<W_BN, W_LDB> tb(Bz, ldb, n0, BT ? n : 0, k);
    // Interior tiles of aligned operands copy every slice but a partial last one without
    // predicates (the general path costs ~150 instructions per slice).
    const bool inside = fa && fb && m0 + W_BM <= m && n0 + W_BN <= n;
    const i64 k_inside = inside ? k / W_BK * W_BK : 0;  // slices starting below this are whole
    auto issue = [&](int stage, i64 k0) {
      float* a = sA + stage * W_BUFA;
      float* b = sB + stage * W_BUFB;
      const bool in = k0 < k_inside;
      if constexpr (AT) {
#pragma unroll
        for (int q = 0; q < AV; ++q) in ? ca[q].issue_inside(a, k0) : ca[q].issue(a, k0, fa);
      } else {
        ta.issue(a, k0, in);
      }
      if constexpr (BT) {
        tb.issue(b, k0, in);
      } else {
#pragma unroll
        for (int q = 0; q < BV; ++q) in ? cb[q].issue_inside(b, k0) : cb[q].issue(b, k0, fb);
      }
    };
    float acc[W_MS][W_NS][W_TM][W_TN] = {};
    // Prologue: slices 0 .. W_STAGES-2 in flight (one commit group per slice, empty past k). The
    // previous tile's last reads of these buffers are behind the barrier ending its loop.
#pragma unroll
    for (int s = 0; s < W_STAGES - 1; ++s) {
      if (s < nk) issue(s, (i64)s * W_BK);
      cp_async_commit();
    }
    for (int t = 0; t < nk; ++t) {
      cp_async_wait<W_STAGES - 2>();  // slice t has landed (for this thread's copies) ...
      __syncthreads();         // ... and for everyone's; slice t-1's buffer is read by no one
      {
        const int f = t + W_STAGES - 1;
        if (f < nk) issue(f % W_STAGES, (i64)f * W_BK);
        cp_async_commit();
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
    cp_async_wait<0>();      // nothing of this tile left in flight (the empty tail groups)
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

// One block per SM (128 accumulators per thread, as cuBLAS's own SGEMM: ~255 registers). The
// ring is dynamic shared memory (75 KiB at 3 stages: past the 48 KiB a static array may take on
// sm_80); the host passes W_SMEM_BYTES (matmul::cuda::WARPTILE_SMEM).
constexpr unsigned W_SMEM_BYTES = W_STAGES * (W_BUFA + W_BUFB) * sizeof(float);
extern "C" __global__ void __launch_bounds__(W_NT, 1) matmul_warptile(FE_MATMUL_PARAMS) {
  // The tile code assumes exactly W_NT threads and the whole ring: a host/kernel mismatch must
  // fail loudly.
  if (blockDim.x * blockDim.y * blockDim.z != W_NT || dynamic_smem_bytes() < W_SMEM_BYTES) __trap();
  extern __shared__ __align__(16) float w_ring[];
  float* sA = w_ring;
  float* sB = w_ring + W_STAGES * W_BUFA;
  FE_LAYOUT_DISPATCH(warptile_body, sA, sB, );
}
