// w8a16 — int8 weights, 16-bit activations: D[i][j] = s[j] · Σ_p A[i][p]·W[j][p] (+ bias[j]),
// A [m][k] bf16/f16 rows lda apart, W [n][k] int8 rows ldw apart (a linear layer's weight with one
// scale per output channel), fp32 accumulation, D [m][n] in A's dtype.
//
// Specialised by -DFE_ELEM (__nv_bfloat16 or __half) and -DFE_NT (tiles of 8 rows of A per
// block: 1, 2 or 4).
//
// step 1 — `w8a16_naive`: one thread per output, the weight byte converted as it is read. Any
// shape, any alignment; every A element is read n times (from L2): no reuse.
//
// step 2 — `w8a16_mma`: decoding is a stream over the weight (1 byte per multiply-add at m = 1),
// so the kernel is built to read W once at the copy rate with as few instructions per byte as
// possible (at 4 TB/s an SM gets ~15 weight bytes per clock: an instruction per byte would be
// four times its issue rate):
// - W is read with 16-byte loads, each lane its own 16 bytes of a weight row per 64-deep k chunk;
//   a warp covers 32 rows × 64 k per chunk, the block's 8 warps take the chunks of its k range in
//   turn, and the 8 partial results are added through shared memory in warp order
//   (deterministic). The next chunk's loads are issued before the current one is used.
// - The products run on tensor cores (mma.m16n8k16, fp32 accumulate) with the WEIGHT as the
//   16-row operand and 8 rows of A as the 8-column one: the converted weight pairs are written
//   by the conversion straight into the A-fragment registers, A's 16-byte loads are already the
//   B fragments' register pairs (no moves), and m ≤ 8 takes one MMA per 16 weight rows × 16 k.
//   More rows of A: FE_NT tiles of 8 per pass, each converted weight word used for all of them
//   (more than 8·FE_NT rows: groups in grid.z, each reading the weight again).
// - The k order inside a chunk is permuted so that each lane's 16 bytes are exactly its four
//   MMAs' fragments: lane (g = lane/4, q = lane%4) holds W[row][16q .. 16q+15], and MMA j takes
//   bytes 4j, 4j+1 as its local k (2q, 2q+1) and 4j+2, 4j+3 as (2q+8, 2q+9); A is read with the
//   same permutation (A[r][16q + 4j .. 4j+3]), so each sum is the same dot product.
// - int8 → 16-bit without I2F (a quarter-rate conversion on sm_90): for bf16, each biased byte
//   (w ^ 0x80) is placed under the exponent of 2^23 (one PRMT), 2^23 + 128 subtracted (one FADD,
//   exact), and two floats' upper halves packed into a bf16x2 (one PRMT); for f16, two biased
//   bytes under 0x64 (1024 + u, one PRMT) and 1152 subtracted (one HSUB2) — exact, since every
//   int8 is a 16-bit float.
// - Split-K across blocks where the weight has too few rows to fill the GPU (the host picks
//   `splits`): each split writes fp32 partials [splits][m][n] and `w8a16_reduce` adds them in
//   split order, scales, adds the bias and rounds (deterministic). Without a split the block
//   writes D itself.
// Requirements (the host checks them, else it runs `naive`): k a multiple of 16, W and A 16-byte
// aligned with row pitches of 16-byte multiples.

#include "ferrite.cuh"
#include "mma.cuh"
using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM __nv_bfloat16
#endif
#ifndef FE_NT
#define FE_NT 1
#endif
typedef FE_ELEM T;
constexpr bool IS_BF16 = IsBf16<T>::value;
constexpr int NT = FE_NT;           // tiles of 8 rows of A per block
constexpr int WARPS = 8;            // k-chunk interleave within a block
constexpr int NTILES = 4;           // weight rows per lane (g, g + 8, g + 16, g + 24): 32 per warp
constexpr int ROWS = 8 * NTILES;    // weight rows (output columns) per block
constexpr int KCHUNK = 64;          // k per warp step: 32 lanes × 16 bytes over 8 rows

extern "C" __global__ void __launch_bounds__(256)
    w8a16_naive(T* __restrict__ D, const T* __restrict__ A, const signed char* __restrict__ W,
                const float* __restrict__ scale, const T* __restrict__ bias, i64 m, i64 n, i64 k,
                i64 lda, i64 ldw, i64 ldd) {
  const i64 j = (i64)blockIdx.x * 16 + threadIdx.x % 16;
  if (j >= n) return;
  for (i64 i = (i64)blockIdx.y * 16 + threadIdx.x / 16; i < m; i += (i64)gridDim.y * 16) {
    const T* a = A + i * lda;
    const signed char* w = W + j * ldw;
    float acc = 0.f;
    for (i64 p = 0; p < k; ++p) acc += to_float(a[p]) * (float)w[p];
    float v = acc * scale[j];
    if (bias) v += to_float(bias[j]);
    D[i * ldd + j] = from_float<T>(v);
  }
}

// Bytes 2h, 2h+1 of a word of four int8 as one register of two 16-bit T values (low half = byte
// 2h), exactly. `u` is the word with every byte biased by 128 (w ^ 0x80808080).
template <int H>
__device__ __forceinline__ unsigned int8_pair(unsigned u) {
  if constexpr (IS_BF16) {
    const float lo = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540 + 2 * H)) - 8388736.f;
    const float hi = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541 + 2 * H)) - 8388736.f;
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
  } else {
    // half2(1024 + u0, 1024 + u1) − 1152
    unsigned h = __byte_perm(u, 0x64646464u, H == 0 ? 0x5140 : 0x5342);
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&h), __floats2half2_rn(1152.f, 1152.f));
    return *reinterpret_cast<unsigned*>(&r);
  }
}

// Sixteen consecutive A elements of row r (k contiguous) as 8 registers of pairs; zeros past m.
__device__ __forceinline__ void load_a16(unsigned (&v)[8], const T* __restrict__ A, i64 lda, i64 r,
                                         i64 m, i64 k0) {
  if (r < m) {
    const uint4* p = reinterpret_cast<const uint4*>(A + r * lda + k0);
    const uint4 x = __ldg(p), y = __ldg(p + 1);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0u;
  }
}

// The weight's 16 bytes of chunk c for each of this lane's four rows (zeros past k or n).
__device__ __forceinline__ void load_w(uint4 (&wv)[NTILES], const signed char* const (&wrow)[NTILES],
                                       const bool (&row_ok)[NTILES], i64 c, i64 c1, i64 k, int q) {
  const bool ok = c < c1 && c * KCHUNK + 16 * q < k;
#pragma unroll
  for (int t = 0; t < NTILES; ++t)
    wv[t] = ok && row_ok[t] ? __ldg(reinterpret_cast<const uint4*>(wrow[t] + c * KCHUNK))
                            : make_uint4(0u, 0u, 0u, 0u);  // int8 zeros
}

// Two blocks per SM up to two tiles of A (ptxas would otherwise cap registers at 64 and spill on
// sm_80); with four the accumulators and A's fragments take more, one block.
extern "C" __global__ void __launch_bounds__(256, NT <= 2 ? 2 : 1)
    w8a16_mma(T* __restrict__ D, float* __restrict__ part, const T* __restrict__ A,
              const signed char* __restrict__ W, const float* __restrict__ scale,
              const T* __restrict__ bias, i64 m, i64 n, i64 k, i64 lda, i64 ldw, i64 ldd,
              int splits) {
  __shared__ float red[WARPS][8][ROWS + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const i64 n0 = (i64)blockIdx.x * ROWS;
  const i64 m0 = (i64)blockIdx.z * NT * 8;
  // This split's chunks: an even share of ⌈k / 64⌉, the last one possibly partial (k % 16 == 0,
  // so a lane's 16 bytes are wholly inside or wholly past k).
  const i64 chunks = (k + KCHUNK - 1) / KCHUNK;
  const i64 per = (chunks + splits - 1) / splits;
  const i64 c0 = (i64)blockIdx.y * per, c1 = min(chunks, c0 + per);

  // acc[h][a]: weight rows 16h + (g, g + 8) × rows 8a + (2q, 2q + 1) of A.
  float acc[2][NT][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int a = 0; a < NT; ++a)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][a][i] = 0.f;

  const signed char* wrow[NTILES];
  bool row_ok[NTILES];
#pragma unroll
  for (int t = 0; t < NTILES; ++t) {
    const i64 r = n0 + 8 * t + g;
    row_ok[t] = r < n;
    wrow[t] = W + (row_ok[t] ? r : 0) * ldw + 16 * q;
  }

  uint4 wv[NTILES];
  load_w(wv, wrow, row_ok, c0 + warp, c1, k, q);
#pragma unroll 2  // two chunks per pass: the two weight buffers swap roles instead of being copied
  for (i64 c = c0 + warp; c < c1; c += WARPS) {
    uint4 wn[NTILES];
    load_w(wn, wrow, row_ok, c + WARPS, c1, k, q);
    const i64 kk = c * KCHUNK + 16 * q;  // this lane's first k
    const bool k_ok = kk < k;
    // A fragments of the weight: [h][j] = rows 16h + g and 16h + g + 8, MMA j's bytes.
    unsigned wa[2][4][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 lo = wv[2 * h], hi = wv[2 * h + 1];
      const unsigned wl[4] = {lo.x ^ 0x80808080u, lo.y ^ 0x80808080u, lo.z ^ 0x80808080u,
                              lo.w ^ 0x80808080u};
      const unsigned wh[4] = {hi.x ^ 0x80808080u, hi.y ^ 0x80808080u, hi.z ^ 0x80808080u,
                              hi.w ^ 0x80808080u};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wa[h][j][0] = int8_pair<0>(wl[j]);
        wa[h][j][1] = int8_pair<0>(wh[j]);
        wa[h][j][2] = int8_pair<1>(wl[j]);
        wa[h][j][3] = int8_pair<1>(wh[j]);
      }
    }
#pragma unroll
    for (int a = 0; a < NT; ++a) {
      unsigned x[8];  // row 8a + g of A's tile: B fragment pairs (x[2j], x[2j + 1])
      load_a16(x, A, lda, m0 + 8 * a + g, k_ok ? m : 0, kk);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_m16n8k16<IS_BF16>(acc[h][a], wa[h][j], x[2 * j], x[2 * j + 1]);
    }
#pragma unroll
    for (int t = 0; t < NTILES; ++t) wv[t] = wn[t];
  }

  // The 8 warps' partial sums of the block's outputs, added in warp order, one tile of A's rows
  // (8 rows × 32 columns of D) at a time through the same buffer.
#pragma unroll
  for (int a = 0; a < NT; ++a) {
    if (a > 0) __syncthreads();  // the previous tile's readers are done with `red`
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      red[warp][2 * q][16 * h + g] = acc[h][a][0];
      red[warp][2 * q + 1][16 * h + g] = acc[h][a][1];
      red[warp][2 * q][16 * h + g + 8] = acc[h][a][2];
      red[warp][2 * q + 1][16 * h + g + 8] = acc[h][a][3];
    }
    __syncthreads();
    {
      const int r = threadIdx.x / ROWS, col = threadIdx.x % ROWS;  // 256 threads = 8 × 32
      const i64 i = m0 + 8 * a + r, j = n0 + col;
      if (i < m && j < n) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red[w][r][col];
        if (splits > 1) {
          part[((i64)blockIdx.y * m + i) * n + j] = s;
        } else {
          float v = s * scale[j];
          if (bias) v += to_float(bias[j]);
          D[i * ldd + j] = from_float<T>(v);
        }
      }
    }
  }
}

// D = scale ⊙ (Σ over splits of the partials, in split order) + bias.
extern "C" __global__ void __launch_bounds__(256)
    w8a16_reduce(T* __restrict__ D, const float* __restrict__ part, const float* __restrict__ scale,
                 const T* __restrict__ bias, i64 m, i64 n, i64 ldd, int splits) {
  const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= m * n) return;
  const i64 i = e / n, j = e % n;
  float s = 0.f;
  for (int p = 0; p < splits; ++p) s += part[(i64)p * m * n + e];
  float v = s * scale[j];
  if (bias) v += to_float(bias[j]);
  D[i * ldd + j] = from_float<T>(v);
}
