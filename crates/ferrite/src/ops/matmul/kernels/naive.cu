// matmul/naive — step 1 of the CUDA ladder.
//
// One thread computes one element of C, reading its row of op(A) and its column of op(B) straight
// from global memory. A warp covers 32 consecutive columns of one row, so the B loads of a warp
// are coalesced (row-major B) and the A load is one broadcast; but every operand element is
// re-read from L2/DRAM by each of the threads that need it: arithmetic intensity ~0.25 FLOP/B,
// so this kernel is bound by memory traffic, far from the tensor cores. Later steps tile through
// shared memory and registers to reuse each loaded element many times.
//
// Specialised by -DFE_ELEM=<storage type> (float, __half, __nv_bfloat16); accumulates in fp32.
// Supports any m, n, k, both transposes, strided batches (stride 0 broadcasts) and alpha/beta;
// the grid loops over rows and batches beyond the launch's y/z limits.

// With -DFE_EPI the store applies the fused epilogue (bias, activation, residual; common.cuh).
// cuda.rs prepends common.cuh (FE_MATMUL_PARAMS, T, the epilogue).

extern "C" __global__ void matmul_naive(FE_MATMUL_PARAMS FE_EPI_PARAMS) {
  const FeEpi epi = FE_EPI_MAKE;
  const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= n) return;
  // Element strides of op(A) along p and op(B) along p.
  const i64 a_row_step = a_trans ? 1 : lda;
  const i64 a_p_step = a_trans ? lda : 1;
  const i64 b_p_step = b_trans ? 1 : ldb;
  const i64 b_col_step = b_trans ? ldb : 1;
  for (i64 z = blockIdx.z; z < batch; z += gridDim.z) {
    const T* a_batch = A + z * stride_a;
    const T* b_col = B + z * stride_b + col * b_col_step;
    T* c_batch = C + z * stride_c;
    for (i64 row = (i64)blockIdx.y * blockDim.y + threadIdx.y; row < m;
         row += (i64)gridDim.y * blockDim.y) {
      const T* a_row = a_batch + row * a_row_step;
      float acc = 0.f;
      for (i64 p = 0; p < k; ++p) {
        acc = fmaf(to_float(a_row[p * a_p_step]), to_float(b_col[p * b_p_step]), acc);
      }
      T* c = c_batch + row * ldc + col;
      // beta == 0 never reads C, so an uninitialised (NaN) output cannot leak in.
      float v = alpha * acc;
      if (beta != 0.f) v = fmaf(beta, to_float(*c), v);
      *c = from_float<T>(fe_epilogue(epi, v, z, row, col));
    }
  }
}
