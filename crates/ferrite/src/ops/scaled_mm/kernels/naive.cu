// scaled_mm/naive — step 1 of the CUDA ladder: one thread per output element, each FP8 input
// decoded in integer arithmetic (fp8.cuh) as it is read, an fp32 dot product over k, then the
// scales and the bias. Any GPU; the reference the tensor-core rungs are checked against on the
// device. Reads of A and B are not shared between threads (every element of A is read n times
// from L2): no reuse, by design of the first rung.
//
// D[i][j] = sa(i) · sb(j) · Σ_p A[i][p]·B[j][p] + bias[j], with A [m][k] rows lda apart and B
// [n][k] rows ldb apart (k contiguous in both: the layout torch._scaled_mm's b.t() and a linear
// layer's weight have); sa(i) = scale_a[sa_row ? i : 0], sb(j) = scale_b[sb_col ? j : 0].
#include "fp8.cuh"

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
typedef FE_OUT TO;

extern "C" __global__ void __launch_bounds__(256)
    scaled_mm_naive(TO* __restrict__ D, const unsigned char* __restrict__ A,
                    const unsigned char* __restrict__ B, const float* __restrict__ scale_a,
                    const float* __restrict__ scale_b, const TO* __restrict__ bias, i64 m, i64 n,
                    i64 k, i64 lda, i64 ldb, i64 ldd, int sa_row, int sb_col) {
  const i64 j = (i64)blockIdx.x * 16 + threadIdx.x % 16;
  for (i64 i = (i64)blockIdx.y * 16 + threadIdx.x / 16; i < m; i += (i64)gridDim.y * 16) {
    if (j >= n) return;
    const unsigned char* a = A + i * lda;
    const unsigned char* b = B + j * ldb;
    float acc = 0.f;
    for (i64 p = 0; p < k; ++p) acc += fp8_to_float<FE_A_E5M2>(a[p]) * fp8_to_float<FE_B_E5M2>(b[p]);
    float v = acc * scale_a[sa_row ? i : 0] * scale_b[sb_col ? j : 0];
    if (bias) v += to_float(bias[j]);
    D[i * ldd + j] = from_float<TO>(v);
  }
}
