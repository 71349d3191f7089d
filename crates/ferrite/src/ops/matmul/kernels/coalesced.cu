// matmul/coalesced — step 2 of the CUDA ladder (fp32 SIMT).
//
// Changes vs naive: still one thread per output element straight from global memory, but
// (1) blocks of 32×32 threads cover a 32×32 tile of C, so 32 rows of a block share every B line
//     and 32 columns share every A line in L1 (naive's 32×8 block shares B over 8 rows only);
// (2) the lane → (row, column) map follows the layout: lanes walk columns of C (B row-major is
//     then read 128 bytes per warp per step, A is a broadcast), except for TT where both operands
//     are stored transposed and lanes walk rows instead (A^T is then contiguous along the lanes
//     and B^T becomes the broadcast). naive reads B^T with a stride of ldb across lanes: one 32-byte
//     sector per lane per multiply-add.
// Why faster: fewer sectors per request (coalescing) and more L1 reuse per block. naive already
// maps threadIdx.x to columns, so for NN the change is the block shape only.
// Expected effect (H100, 4096³ NN f32): about 1.0–1.5× naive (L1 hit rate, not coalescing); TT up
// to several × naive. Still memory-bound: every FMA issues two loads (~0.25 FLOP per byte of L1
// traffic), far below the SM's FMA rate.

template <bool AT, bool BT>
__device__ __forceinline__ void coalesced_body(FE_MATMUL_PARAMS) {
  constexpr bool LANES_ALONG_M = AT && BT;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int ti = LANES_ALONG_M ? lane : w, tj = LANES_ALONG_M ? w : lane;
  const i64 a_i = AT ? 1 : lda, a_p = AT ? lda : 1;
  const i64 b_p = BT ? 1 : ldb, b_j = BT ? ldb : 1;
  const i64 j = (i64)blockIdx.x * 32 + tj;
  FE_FOR_EACH_TILE(32) {
    const i64 i = m0 + ti;
    if (i < m && j < n) {
      const float* a = A + z * stride_a + i * a_i;
      const float* b = B + z * stride_b + j * b_j;
      float acc = 0.f;
      for (i64 p = 0; p < k; ++p) acc = fmaf(a[p * a_p], b[p * b_p], acc);
      fe_store(C + z * stride_c + i * ldc + j, acc, alpha, beta);
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024) matmul_coalesced(FE_MATMUL_PARAMS) {
  FE_LAYOUT_DISPATCH(coalesced_body, );
}
