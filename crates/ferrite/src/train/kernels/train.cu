// train — the small kernels a training step needs between ferrite's op families:
//
//   split_tokens        [B, T+1] token rows → contiguous inputs [B·T] and targets [B·T] (i32), so
//                       the loader's ring slot is released at once and cross-entropy gets the
//                       contiguous targets it takes.
//   embed_forward       out[i] = wte[tok[i]] + wpe[i mod T] (wpe optional); an out-of-range token
//                       writes a NaN row (never an out-of-bounds read) so a bad batch cannot hide.
//   embed_sort          one block sorts a chunk of ≤ FE_SORT_N (token, position) keys in shared
//                       memory (bitonic): the embedding backward's deterministic grouping.
//   embed_backward      one block per run of equal tokens in the sorted chunk: the run's dout rows
//                       summed in position order in fp32, added once to dwte[token]. No atomics:
//                       the same bits every run, and one rounding per (token, chunk).
//   pos_backward        dwpe[t] = Σ_b dout[b, t] in batch order (deterministic, overwrites).
//   add_inplace         y += x (the residual stream's gradient meeting a norm's input gradient),
//                       16-byte vectors.
//   accumulate          acc (fp32) = g or acc += g (gradient accumulation over micro-batches).
//   rope                rotary embeddings in place on the q and k heads of a [N, width] QKV buffer
//                       (Llama's halves convention: element i pairs with i + D/2), or the inverse
//                       rotation on their gradient.
//   sumsq_partial/final Σ g² over a flat gradient in a fixed order (global-norm clipping).
//
// Specialisation: -DFE_T=<float | __nv_bfloat16 | __half> (activations, params, grads),
// -DFE_G=<FE_T | float> (the gradient read by sumsq).

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_T
#define FE_T float
#endif
#ifndef FE_G
#define FE_G FE_T
#endif
// Keys one embed_sort block sorts (a power of two; 8 bytes each in dynamic shared memory).
#ifndef FE_SORT_N
#define FE_SORT_N 8192
#endif

typedef FE_T T;
typedef FE_G G;

extern "C" __global__ void split_tokens(const int* __restrict__ tok, i64 ld, int rows, int seq,
                                        int* __restrict__ inputs, int* __restrict__ targets) {
  const i64 n = (i64)rows * seq;
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 b = i / seq, t = i - b * seq;
    inputs[i] = tok[b * ld + t];
    targets[i] = tok[b * ld + t + 1];
  }
}

// One block per token row; threads stride over the channels.
extern "C" __global__ void embed_forward(const int* __restrict__ tok, const T* __restrict__ wte,
                                         const T* __restrict__ wpe, T* __restrict__ out, int seq,
                                         int channels, int vocab) {
  const i64 i = blockIdx.x;
  const int id = tok[i];
  const int t = (int)(i % seq);
  T* o = out + i * channels;
  if (id < 0 || id >= vocab) {
    for (int c = threadIdx.x; c < channels; c += blockDim.x) o[c] = from_float<T>(__int_as_float(0x7fc00000));
    return;
  }
  const T* e = wte + (i64)id * channels;
  const T* p = wpe ? wpe + (i64)t * channels : nullptr;
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    float v = to_float(e[c]);
    if (p) v += to_float(p[c]);
    o[c] = from_float<T>(v);
  }
}

// Sorts keys (token << 32 | position) of positions [start, start + n) ascending; tokens out of
// range get the largest key and sort last (embed_backward skips them).
extern "C" __global__ void embed_sort(const int* __restrict__ tok, i64 start, int n, int vocab,
                                      unsigned long long* __restrict__ keys) {
  extern __shared__ unsigned long long sk[];
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    unsigned long long k = ~0ull;
    if (i < n) {
      const int id = tok[start + i];
      if (id >= 0 && id < vocab) k = ((unsigned long long)id << 32) | (unsigned)(start + i);
    }
    sk[i] = k;
  }
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int l = i ^ j;
        if (l > i) {
          const unsigned long long a = sk[i], b = sk[l];
          const bool up = (i & k) == 0;
          if ((a > b) == up) {
            sk[i] = b;
            sk[l] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = sk[i];
}

// Block j starts a run when its key's token differs from key j−1's; it sums the run's dout rows
// (in position order) and adds the sum to dwte[token]. Keys are staged 256 at a time in shared
// memory so each thread's loads over the run are independent (many in flight).
extern "C" __global__ void embed_backward(const unsigned long long* __restrict__ keys, int n,
                                          const T* __restrict__ dout, T* __restrict__ dwte,
                                          int channels) {
  __shared__ int pos[256];
  __shared__ int run_len;
  const int j = blockIdx.x;
  const unsigned long long key = keys[j];
  if (key == ~0ull) return;
  const unsigned tokid = (unsigned)(key >> 32);
  if (j > 0 && (unsigned)(keys[j - 1] >> 32) == tokid) return;
  if (threadIdx.x == 0) {
    int e = j + 1;
    while (e < n && (unsigned)(keys[e] >> 32) == tokid) ++e;
    run_len = e - j;
  }
  __syncthreads();
  const int len = run_len;
  T* dst = dwte + (i64)tokid * channels;
  for (int c0 = 0; c0 < channels; c0 += blockDim.x) {
    const int c = c0 + threadIdx.x;
    float acc = 0.f;
    for (int r0 = 0; r0 < len; r0 += 256) {
      const int m = min(256, len - r0);
      __syncthreads();
      for (int r = threadIdx.x; r < m; r += blockDim.x) pos[r] = (int)(keys[j + r0 + r] & 0xffffffffu);
      __syncthreads();
      if (c < channels) {
#pragma unroll 8
        for (int r = 0; r < m; ++r) acc += to_float(dout[(i64)pos[r] * channels + c]);
      }
    }
    if (c < channels) dst[c] = from_float<T>(to_float(dst[c]) + acc);
  }
}

// grid (seq), threads over channels; dwpe[t] = Σ_b dout[b·seq + t].
extern "C" __global__ void pos_backward(const T* __restrict__ dout, T* __restrict__ dwpe, int rows,
                                        int seq, int channels) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    float acc = 0.f;
    for (int b = 0; b < rows; ++b) acc += to_float(dout[((i64)b * seq + t) * channels + c]);
    dwpe[(i64)t * channels + c] = from_float<T>(acc);
  }
}

// 16-byte accesses where both pointers allow (the residual stream's buffers always do), the
// remainder (or everything, unaligned) one element at a time.
extern "C" __global__ void add_inplace(T* __restrict__ y, const T* __restrict__ x, i64 n) {
  constexpr int V = 16 / sizeof(T);
  const i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  const bool vec = ((((u64)y) | ((u64)x)) & 15u) == 0;
  const i64 nv = vec ? n / V : 0;
  for (i64 i = tid; i < nv; i += stride) {
    uint4 a = reinterpret_cast<uint4*>(y)[i];
    const uint4 b = reinterpret_cast<const uint4*>(x)[i];
    T* pa = reinterpret_cast<T*>(&a);
    const T* pb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int e = 0; e < V; ++e) pa[e] = from_float<T>(to_float(pa[e]) + to_float(pb[e]));
    reinterpret_cast<uint4*>(y)[i] = a;
  }
  for (i64 i = nv * V + tid; i < n; i += stride) y[i] = from_float<T>(to_float(y[i]) + to_float(x[i]));
}

extern "C" __global__ void accumulate(float* __restrict__ acc, const T* __restrict__ g, i64 n, int first) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    acc[i] = first ? to_float(g[i]) : acc[i] + to_float(g[i]);
}

// Each block writes its partial Σ g² (grid-stride with 16-byte loads, so the partition depends on
// the grid and the buffer's alignment only: the same bits every run).
extern "C" __global__ void sumsq_partial(const G* __restrict__ g, i64 n, float* __restrict__ part) {
  __shared__ float red[64];
  constexpr int V = 16 / sizeof(G);
  const i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  const i64 nv = (((u64)g) & 15u) == 0 ? n / V : 0;
  float s = 0.f;
  for (i64 i = tid; i < nv; i += stride) {
    const uint4 a = reinterpret_cast<const uint4*>(g)[i];
    const G* pa = reinterpret_cast<const G*>(&a);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float v = to_float(pa[e]);
      s += v * v;
    }
  }
  for (i64 i = nv * V + tid; i < n; i += stride) {
    const float v = to_float(g[i]);
    s += v * v;
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

extern "C" __global__ void sumsq_final(const float* __restrict__ part, int nparts, float* __restrict__ out) {
  __shared__ float red[64];
  float s = 0.f;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += part[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) out[0] = s;
}

// One block per token row; threads over (head, pair). Row n holds `heads` heads of D elements
// from its start (q heads, then k heads); position pos0 + n mod seq; angle pos·θ^(−2i/D) in fp32 with
// accurate sincosf (positions up to ~10⁵ radians keep ~1e-6 relative error).
extern "C" __global__ void rope(T* __restrict__ x, i64 ld, int seq, i64 pos0, int heads, int dim,
                                float log2_theta, int inverse) {
  const i64 n = blockIdx.x;
  const int half = dim / 2;
  const float pos = (float)(pos0 + n % seq);
  T* row = x + n * ld;
  for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int h = e / half, i = e - h * half;
    const float inv_freq = exp2f(-(2.f * (float)i / (float)dim) * log2_theta);
    float sn, cs;
    sincosf(pos * inv_freq, &sn, &cs);
    if (inverse) sn = -sn;
    T* p = row + (i64)h * dim;
    const float a = to_float(p[i]), b = to_float(p[i + half]);
    p[i] = from_float<T>(a * cs - b * sn);
    p[i + half] = from_float<T>(b * cs + a * sn);
  }
}
