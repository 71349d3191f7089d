// matmul/common.cuh — shared by the tiled CUDA matmul kernels (cuda.rs prepends it to each
// module's source; it is not a standalone header).
//
// Conventions every kernel here follows:
// - One launch signature (the same as naive.cu): C, A, B, m, n, k, lda, ldb, ldc, a_trans,
//   b_trans, batch strides, batch, alpha, beta. op(A)[i][p] = A[a_trans ? p*lda + i : i*lda + p],
//   op(B)[p][j] = B[b_trans ? j*ldb + p : p*ldb + j], C[i][j] = C[i*ldc + j].
// - Block (x, y, z) computes the BM×BN tile of C at row blockIdx.y*BM, column blockIdx.x*BN of
//   batch blockIdx.z, and strides over further row tiles and batches by gridDim.y / gridDim.z
//   (the launch clamps y and z to 65535), so any m and batch are covered.
// - Index products are 64-bit (i64); tiles at the edges are zero-filled on load and predicated on
//   store, so any m, n, k works (k = 0 writes alpha*0 + beta*C).
// - beta == 0 never reads C (the output may hold NaN).
// - The layout (a_trans, b_trans) is dispatched once at kernel entry to a body templated on it,
//   so the inner loops carry no layout branches.
#include "ferrite.cuh"
#include "sfu.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif
typedef FE_ELEM T;

#define FE_MATMUL_PARAMS                                                                     \
  T *__restrict__ C, const T *__restrict__ A, const T *__restrict__ B, i64 m, i64 n, i64 k, \
      i64 lda, i64 ldb, i64 ldc, int a_trans, int b_trans, i64 stride_a, i64 stride_b,     \
      i64 stride_c, i64 batch, float alpha, float beta
#define FE_MATMUL_ARGS \
  C, A, B, m, n, k, lda, ldb, ldc, a_trans, b_trans, stride_a, stride_b, stride_c, batch, alpha, beta

// Calls body<a_trans, b_trans>(extra..., FE_MATMUL_ARGS).
#define FE_LAYOUT_DISPATCH(body, ...)                   \
  do {                                                  \
    if (a_trans) {                                      \
      if (b_trans)                                      \
        body<true, true>(__VA_ARGS__ FE_MATMUL_ARGS);   \
      else                                              \
        body<true, false>(__VA_ARGS__ FE_MATMUL_ARGS);  \
    } else {                                            \
      if (b_trans)                                      \
        body<false, true>(__VA_ARGS__ FE_MATMUL_ARGS);  \
      else                                              \
        body<false, false>(__VA_ARGS__ FE_MATMUL_ARGS); \
    }                                                   \
  } while (0)

// Loop over the (batch z, row-tile origin m0) pairs this block owns. Block-uniform, so
// __syncthreads() inside is safe.
#define FE_FOR_EACH_TILE(BM_)                                  \
  for (i64 z = blockIdx.z; z < batch; z += gridDim.z)          \
    for (i64 m0 = (i64)blockIdx.y * (BM_); m0 < m; m0 += (i64)gridDim.y * (BM_))

// Whether 16-byte accesses are possible along an operand's rows: base address 16-byte aligned and
// every row/batch start too (ld and batch stride multiples of 16 bytes). Block-uniform.
__device__ __forceinline__ bool fe_aligned16(const void* p, i64 ld, i64 stride) {
  return ((u64)p % 16 == 0) && ((ld * (i64)sizeof(T)) % 16 == 0) &&
         ((stride * (i64)sizeof(T)) % 16 == 0);
}

// C element update: alpha*acc (+ beta*C only when beta != 0).
template <typename U>
__device__ __forceinline__ void fe_store(U* c, float acc, float alpha, float beta) {
  float v = alpha * acc;
  if (beta != 0.f) v = fmaf(beta, to_float(*c), v);
  *c = from_float<U>(v);
}

// ---- fp32 SIMT tile loaders -------------------------------------------------------------------

// Copies the R×CN tile of op(X) at (r0, c0) into shared memory, element (r, c) to s[r*SR + c*SC],
// zero outside rows × cols. op(X)[r][c] = X[TR ? c*ld + r : r*ld + c]; consecutive threads walk
// X's contiguous dimension, so a warp's global loads are coalesced in every layout.
template <int R, int CN, int NT, bool TR, int SR, int SC>
__device__ __forceinline__ void fe_load_tile(float* __restrict__ s, const float* __restrict__ X,
                                             i64 ld, i64 r0, i64 c0, i64 rows, i64 cols) {
  const int t = threadIdx.x;
#pragma unroll
  for (int e0 = 0; e0 < R * CN; e0 += NT) {
    const int e = e0 + t;
    if ((R * CN) % NT != 0 && e >= R * CN) break;
    const int r = TR ? e % R : e / CN;
    const int c = TR ? e / R : e % CN;
    const i64 gr = r0 + r, gc = c0 + c;
    float v = 0.f;
    if (gr < rows && gc < cols) v = X[TR ? gc * ld + gr : gr * ld + gc];
    s[r * SR + c * SC] = v;
  }
}

// The same tile in 4-element vectors along X's contiguous dimension, held in registers between
// load() (global → registers) and store() (registers → shared), so a kernel can issue the next
// tile's loads before computing on the current one. With `fast` (X 16-byte aligned, see
// fe_aligned16) a vector fully inside the matrix is one 128-bit load (LDG.E.128); otherwise its
// four elements are loaded one by one, each predicated (edges, odd ld, unaligned views).
template <int R, int CN, int NT, bool TR>
struct FeVecTile {
  static constexpr int NV = R * CN / 4 / NT;
  static_assert(NV >= 1 && (R * CN) % (4 * NT) == 0, "tile must split into whole vectors per thread");
  float4 v[NV];

  __device__ __forceinline__ static void coords(int q, int& vr, int& vc) {
    const int e = threadIdx.x + q * NT;
    vr = TR ? (e % (R / 4)) * 4 : e / (CN / 4);
    vc = TR ? e / (R / 4) : (e % (CN / 4)) * 4;
  }

  __device__ __forceinline__ void load(const float* __restrict__ X, i64 ld, i64 r0, i64 c0,
                                       i64 rows, i64 cols, bool fast) {
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      int vr, vc;
      coords(q, vr, vc);
      const i64 gr = r0 + vr, gc = c0 + vc;
      const float* p = X + (TR ? gc * ld + gr : gr * ld + gc);
      const bool line_ok = TR ? gc < cols : gr < rows;  // the row (column) of the vector exists
      const i64 first = TR ? gr : gc;                   // index of element 0 along the vector
      const i64 lim = TR ? rows : cols;
      if (fast && line_ok && first + 3 < lim) {
        v[q] = __ldg(reinterpret_cast<const float4*>(p));
      } else {
        v[q].x = (line_ok && first + 0 < lim) ? p[0] : 0.f;
        v[q].y = (line_ok && first + 1 < lim) ? p[1] : 0.f;
        v[q].z = (line_ok && first + 2 < lim) ? p[2] : 0.f;
        v[q].w = (line_ok && first + 3 < lim) ? p[3] : 0.f;
      }
    }
  }

  // Element (r, c) to s[r*SR + c*SC]: one 128-bit store when the vector is contiguous in shared
  // memory too, else four scalar stores (the transposing case).
  template <int SR, int SC>
  __device__ __forceinline__ void store(float* __restrict__ s) const {
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      int vr, vc;
      coords(q, vr, vc);
      float* d = s + vr * SR + vc * SC;
      constexpr int step = TR ? SR : SC;
      if (step == 1) {
        *reinterpret_cast<float4*>(d) = v[q];
      } else {
        d[0] = v[q].x;
        d[step] = v[q].y;
        d[2 * step] = v[q].z;
        d[3 * step] = v[q].w;
      }
    }
  }
};

// Four consecutive outputs of a row: one 128-bit access when `fast` and all four are inside,
// else element by element.
__device__ __forceinline__ void fe_store4(float* c, i64 j, i64 n, float4 acc, float alpha,
                                          float beta, bool fast) {
  if (fast && j + 3 < n) {
    float4 v = make_float4(alpha * acc.x, alpha * acc.y, alpha * acc.z, alpha * acc.w);
    if (beta != 0.f) {
      const float4 o = *reinterpret_cast<const float4*>(c);
      v.x = fmaf(beta, o.x, v.x);
      v.y = fmaf(beta, o.y, v.y);
      v.z = fmaf(beta, o.z, v.z);
      v.w = fmaf(beta, o.w, v.w);
    }
    *reinterpret_cast<float4*>(c) = v;
  } else {
    if (j + 0 < n) fe_store(c + 0, acc.x, alpha, beta);
    if (j + 1 < n) fe_store(c + 1, acc.y, alpha, beta);
    if (j + 2 < n) fe_store(c + 2, acc.z, alpha, beta);
    if (j + 3 < n) fe_store(c + 3, acc.w, alpha, beta);
  }
}

// ---- fused epilogue (linear layers) -----------------------------------------------------------
// -DFE_EPI=0 (or absent): the plain GEMM; FeEpi is empty, FE_EPI_PARAMS adds no parameter and
// fe_epilogue returns its argument, so nothing below costs the plain kernels anything.
// -DFE_EPI=1+act (act: 0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf, 4 silu): the kernel takes seven
// more parameters after its own (bias, Z, ldz, stride_z, R, ldr, stride_r; null pointers = absent)
// and every stored element v = alpha*acc (+ beta*C) becomes
//   v += bias[col];  Z[b][row][col] = v;  v = act(v);  v += R[b][row][col]
// in fp32, with one rounding to T at the store (and one for Z).
#ifndef FE_EPI
#define FE_EPI 0
#endif

// -DFE_EPI_PAIRS=1 (with FE_EPI): the pair epilogue of the `*_pairs` linear variants — interior
// tiles stored as 2-element pairs with the bias in registers (wgmma.cu, mma.cu), and for 16-bit
// outputs the activations on the SFU (below). Absent or 0: the element-wise epilogue, unchanged.
#ifndef FE_EPI_PAIRS
#define FE_EPI_PAIRS 0
#endif

// -DFE_EPI_DACT=1 (with FE_EPI = 1 + act; `wgmma` only): the activation's backward instead of
// its forward — the linear backward's dX GEMM forming the layer below's dZ in its epilogue:
//   C(i, j) = (alpha·acc)(i, j) · act'(R(i, j))
// with R the pre-activation that produced this GEMM's X (bias and Z absent). One pass over dX
// less, and no dX → dZ pass: the product goes out rounded once, as the unfused kernels do it.
// One more parameter, `epi_part` (f32, may be null): the column sums of C over each 16-row group
// of rows, part[row / 16][col] (rows n floats apart), summed from the rounded values in the
// TMA staging box in a fixed order — the layer below's bias gradient then needs only the
// m/16 partial rows reduced, not a pass over C. Written only by interior tiles through the TMA
// store; the host passes it only when every tile is one (a kernel that meets another traps).
#ifndef FE_EPI_DACT
#define FE_EPI_DACT 0
#endif
static_assert(!FE_EPI_DACT || FE_EPI, "FE_EPI_DACT needs FE_EPI = 1 + act");

// The 16-bit outputs of the pair epilogue take tanh on the SFU (sfu.cuh's tanh_approx, error
// below their rounding); f32 outputs keep tanhf / erff / expf: their checks hold fp32 accuracy.
constexpr bool FE_FAST_ACT = FE_EPI_PAIRS && sizeof(T) == 2;

// act(v) for activation code ACT (FE_EPI's numbering: 1 none, 2 relu, 3 gelu_tanh, 4 gelu_erf,
// 5 silu), on the SFU when FAST (16-bit outputs). fe_act is the epilogue's; wgmma.cu's GLU build
// (FE_GLU) takes the same formulas with its own code.
template <int ACT, bool FAST>
__device__ __forceinline__ float fe_act_of(float v) {
  if constexpr (ACT == 2) {
    return (v > 0.f || isnan(v)) ? v : 0.f;  // NaN stays NaN, as torch's relu
  } else if constexpr (ACT == 3) {
    if (FAST) {
      // ½v(1 + tanh u) as h + h·tanh u: one FFMA after the tanh.
      const float u = v * fmaf(0.7978845608028654f * 0.044715f, v * v, 0.7978845608028654f);
      const float h = 0.5f * v;
      return fmaf(h, tanh_approx(u), h);
    }
    const float u = 0.7978845608028654f * fmaf(0.044715f * v, v * v, v);
    return 0.5f * v * (1.f + tanhf(u));
  } else if constexpr (ACT == 4) {
    if (FAST) {
      // Φ(v) through erfc(|v|/√2) = t·P(t)·exp(−x²), t = 1/(1 + p·x) (a five-term rational fit,
      // absolute error ≤ 1.5e-7; one RCP and one EX2, no branches). erff branches on |x| per
      // element: in the unrolled wgmma pair epilogue its blocks pushed ptxas into spills. The
      // negative side takes ½erfc directly, so the tail has no cancellation.
      const float x = fabsf(v) * 0.7071067811865476f;
      const float t = __fdividef(1.f, fmaf(0.3275911f, x, 1.f));
      float p = fmaf(t, 1.061405429f, -1.453152027f);
      p = fmaf(t, p, 1.421413741f);
      p = fmaf(t, p, -0.284496736f);
      p = fmaf(t, p, 0.254829592f);
      const float e = t * p * __expf(-x * x);  // erfc(x)
      return v * (v >= 0.f ? fmaf(-0.5f, e, 1.f) : 0.5f * e);
    }
    return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
  } else if constexpr (ACT == 5) {
    if (FAST) {
      // v·σ(v) = ½v(1 + tanh(v/2)): one SFU op instead of EX2 + RCP.
      const float h = 0.5f * v;
      return fmaf(h, tanh_approx(h), h);
    }
    return v / (1.f + expf(-v));
  } else {
    return v;
  }
}
__device__ __forceinline__ float fe_act(float v) { return fe_act_of<FE_EPI, FE_FAST_ACT>(v); }

// act'(v), the backward of fe_act (FE_EPI_DACT): the same formulas as the linear family's
// act_grad (linear.cu), with tanh on the SFU for 16-bit pair epilogues (FE_FAST_ACT).
__device__ __forceinline__ float fe_dact(float v) {
#if FE_EPI == 2
  return v > 0.f ? 1.f : 0.f;
#elif FE_EPI == 3
  // ½(1 + t) + ½v(1 − t²)·c(1 + 3a·v²), t = tanh(c(v + a·v³)).
  const float c = 0.7978845608028654f, a = 0.044715f;
  const float v2 = v * v;
  const float u = c * fmaf(a * v, v2, v);
  const float t = FE_FAST_ACT ? tanh_approx(u) : tanhf(u);
  const float h = 0.5f * v * c * fmaf(3.f * a, v2, 1.f);
  return fmaf(h, fmaf(-t, t, 1.f), fmaf(0.5f, t, 0.5f));
#elif FE_EPI == 4
  // Φ(v) + v·φ(v); for 16-bit outputs Φ through fe_act's erfc fit, which shares its
  // exp(−v²/2) with φ.
  if (FE_FAST_ACT) {
    const float x = fabsf(v) * 0.7071067811865476f;
    const float t = __fdividef(1.f, fmaf(0.3275911f, x, 1.f));
    float p = fmaf(t, 1.061405429f, -1.453152027f);
    p = fmaf(t, p, 1.421413741f);
    p = fmaf(t, p, -0.284496736f);
    p = fmaf(t, p, 0.254829592f);
    const float ex = __expf(-x * x);
    const float e = t * p * ex;  // erfc(x)
    const float cdf = v >= 0.f ? fmaf(-0.5f, e, 1.f) : 0.5f * e;
    return fmaf(v * 0.3989422804014327f, ex, cdf);
  }
  const float pdf = 0.3989422804014327f * expf(-0.5f * v * v);
  return fmaf(0.5f, erff(v * 0.7071067811865476f), 0.5f) + v * pdf;
#elif FE_EPI == 5
  // σ(v)(1 + v(1 − σ(v))), σ(v) = ½(1 + tanh(v/2)) on the SFU for 16-bit outputs.
  const float s = FE_FAST_ACT ? fmaf(0.5f, tanh_approx(0.5f * v), 0.5f)
                              : 1.f / (1.f + expf(-v));
  return s * fmaf(v, 1.f - s, 1.f);
#else
  return 1.f;
#endif
}

struct FeEpi {
#if FE_EPI
  const T* bias;
  T* z;
  const T* r;
  i64 ldz, stride_z, ldr, stride_r;
#if FE_EPI_DACT
  float* part;
#endif
#endif
};

#if FE_EPI && FE_EPI_DACT
#define FE_EPI_PARAMS                                                                     \
  , const T *__restrict__ epi_bias, T *__restrict__ epi_z, i64 epi_ldz, i64 epi_stride_z, \
      const T *__restrict__ epi_r, i64 epi_ldr, i64 epi_stride_r, float *__restrict__ epi_part
#define FE_EPI_MAKE \
  FeEpi{epi_bias, epi_z, epi_r, epi_ldz, epi_stride_z, epi_ldr, epi_stride_r, epi_part}
#elif FE_EPI
#define FE_EPI_PARAMS                                                                     \
  , const T *__restrict__ epi_bias, T *__restrict__ epi_z, i64 epi_ldz, i64 epi_stride_z, \
      const T *__restrict__ epi_r, i64 epi_ldr, i64 epi_stride_r
#define FE_EPI_MAKE FeEpi{epi_bias, epi_z, epi_r, epi_ldz, epi_stride_z, epi_ldr, epi_stride_r}
#else
#define FE_EPI_PARAMS
#define FE_EPI_MAKE FeEpi{}
#endif

// The epilogue of element (row, col) of batch zb, whose GEMM value is v; returns what to store.
__device__ __forceinline__ float fe_epilogue(const FeEpi& e, float v, i64 zb, i64 row, i64 col) {
#if FE_EPI && FE_EPI_DACT
  v *= fe_dact(to_float(e.r[zb * e.stride_r + row * e.ldr + col]));
#elif FE_EPI
  if (e.bias) v += to_float(e.bias[col]);
  if (e.z) e.z[zb * e.stride_z + row * e.ldz + col] = from_float<T>(v);
  v = fe_act(v);
  if (e.r) v += to_float(e.r[zb * e.stride_r + row * e.ldr + col]);
#endif
  return v;
}

// The epilogue's pointers advanced to one output row, for store loops that walk rows: the
// per-element work is then bias[col], z[col], r[col], with no 64-bit index products live.
struct FeEpiRow {
#if FE_EPI
  const T* bias;
  T* z;
  const T* r;
#endif
};

__device__ __forceinline__ FeEpiRow fe_epi_row(const FeEpi& e, i64 zb, i64 row) {
#if FE_EPI
  return FeEpiRow{e.bias, e.z ? e.z + zb * e.stride_z + row * e.ldz : nullptr,
                  e.r ? e.r + zb * e.stride_r + row * e.ldr : nullptr};
#else
  return FeEpiRow{};
#endif
}

__device__ __forceinline__ float fe_epilogue_row(const FeEpiRow& e, float v, i64 col) {
#if FE_EPI && FE_EPI_DACT
  v *= fe_dact(to_float(e.r[col]));
#elif FE_EPI
  if (e.bias) v += to_float(e.bias[col]);
  if (e.z) e.z[col] = from_float<T>(v);
  v = fe_act(v);
  if (e.r) v += to_float(e.r[col]);
#endif
  return v;
}

// fe_store followed by the epilogue (the element-wise store path of the epilogue kernels).
__device__ __forceinline__ void fe_store_epi(T* c, float acc, float alpha, float beta,
                                             const FeEpi& e, i64 zb, i64 row, i64 col) {
  float v = alpha * acc;
  if (beta != 0.f) v = fmaf(beta, to_float(*c), v);
  *c = from_float<T>(fe_epilogue(e, v, zb, row, col));
}

// ---- two adjacent elements as one access (the fast epilogue paths) -----------------------------
// T2: the 2-element vector of T (4 bytes for 16-bit T, 8 for float). fe_ld2 reads one through
// the read-only path (ld.global.nc: the compiler may hoist it above the kernel's own stores),
// fe_st2 rounds two fp32 values and writes them as one store. Both need a T2-aligned address.
template <typename U> struct FeTwo;
template <> struct FeTwo<float> { typedef float2 type; };
template <> struct FeTwo<__half> { typedef __half2 type; };
template <> struct FeTwo<__nv_bfloat16> { typedef __nv_bfloat162 type; };
typedef typename FeTwo<T>::type T2;

__device__ __forceinline__ float2 fe_f2(float2 v) { return v; }
__device__ __forceinline__ float2 fe_f2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 fe_f2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

template <typename V> __device__ __forceinline__ V fe_pack2(float a, float b);
template <> __device__ __forceinline__ float2 fe_pack2<float2>(float a, float b) {
  return make_float2(a, b);
}
template <> __device__ __forceinline__ __half2 fe_pack2<__half2>(float a, float b) {
  return __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ __nv_bfloat162 fe_pack2<__nv_bfloat162>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

__device__ __forceinline__ float2 fe_ld2(const T* p) {
  return fe_f2(__ldg(reinterpret_cast<const T2*>(p)));
}
__device__ __forceinline__ void fe_st2(T* p, float a, float b) {
  *reinterpret_cast<T2*>(p) = fe_pack2<T2>(a, b);
}

// Whether pairs (even column, next) of a row-major matrix at p (rows ld, batches stride apart)
// are T2-aligned; a null (absent) operand is. Block-uniform.
__device__ __forceinline__ bool fe_pairs_aligned(const void* p, i64 ld, i64 stride) {
  return p == nullptr || ((u64)p % sizeof(T2) == 0 && ld % 2 == 0 && stride % 2 == 0);
}
