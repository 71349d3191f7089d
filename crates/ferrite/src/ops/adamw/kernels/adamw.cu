// adamw — one AdamW step (torch.optim.AdamW semantics, decoupled weight decay) over a list of
// tensors, in fp32 arithmetic:
//
//   g  = grad · grad_scale
//   m  = m + (1−β1)·(g − m)               (torch's lerp)
//   v  = β2·v + (1−β2)·g²
//   p  = p·(1 − lr·wd)
//   p  = p − step_size · m / (√v · inv_bc2_sqrt + eps)      step_size = lr / (1 − β1^t),
//                                                          inv_bc2_sqrt = 1 / √(1 − β2^t)
//
// With bf16 params the update runs on an fp32 master copy, and the param is the master rounded
// to nearest. Specialisation: -DFE_PARAM=<float | __nv_bfloat16>, -DFE_GRAD=<float | param type>,
// -DFE_MASTER=<0 | 1>.
//
// step 1 — adamw_naive: one launch per tensor, one element per thread per step (scalar loads).
// step 2 — adamw_multi: one launch for every tensor. The host uploads a table of tensors (five
//   pointers and numel each) and a block → (tensor, chunk) map, so a hundred small tensors cost
//   one launch instead of a hundred; each block updates one CHUNK of one tensor with 4-element
//   vector loads (16 bytes for f32 arrays, 8 for bf16) where the tensor's arrays are aligned.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_PARAM
#define FE_PARAM float
#endif
#ifndef FE_GRAD
#define FE_GRAD FE_PARAM
#endif
#ifndef FE_MASTER
#define FE_MASTER 0
#endif

typedef FE_PARAM P;
typedef FE_GRAD G;

// Elements per block of adamw_multi; a multiple of 4 so every chunk starts vector-aligned.
#define FE_CHUNK 16384

struct Hyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, inv_bc2_sqrt, grad_scale;
};

__device__ __forceinline__ void update(float& p, float& m, float& v, float gr, const Hyper& h) {
  const float g = gr * h.grad_scale;
  m = m + h.one_minus_beta1 * (g - m);
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  p = p * h.decay;
  p = p - h.step_size * m / (sqrtf(v) * h.inv_bc2_sqrt + h.eps);
}

// Element i of one tensor; `master` is null unless FE_MASTER.
__device__ __forceinline__ void update_one(P* p, const G* g, float* m, float* v, float* master,
                                           i64 i, const Hyper& h) {
  float pf = FE_MASTER ? master[i] : to_float(p[i]);
  float mf = m[i], vf = v[i];
  update(pf, mf, vf, to_float(g[i]), h);
  m[i] = mf;
  v[i] = vf;
  if (FE_MASTER) master[i] = pf;
  p[i] = from_float<P>(pf);
}

extern "C" __global__ void adamw_naive(P* p, const G* g, float* m, float* v, float* master, i64 n,
                                       Hyper h) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    update_one(p, g, m, v, master, i, h);
}

// One tensor of the list (48 bytes, as the host writes it).
struct Desc {
  u64 p, g, m, v, master;
  i64 n;
};

// Four consecutive elements of storage type E, loaded and stored as one access.
template <typename E>
struct alignas(4 * sizeof(E)) Pack4 {
  E e[4];
};

__device__ __forceinline__ bool aligned4(u64 a, int es) { return (a & (u64)(4 * es - 1)) == 0; }

extern "C" __global__ void adamw_multi(const Desc* __restrict__ table,
                                       const uint2* __restrict__ blocks, Hyper h) {
  const uint2 tc = blocks[blockIdx.x];
  const Desc d = table[tc.x];
  P* p = reinterpret_cast<P*>(d.p);
  const G* g = reinterpret_cast<const G*>(d.g);
  float* m = reinterpret_cast<float*>(d.m);
  float* v = reinterpret_cast<float*>(d.v);
  float* master = reinterpret_cast<float*>(d.master);
  const i64 start = (i64)tc.y * FE_CHUNK;
  const i64 end = min(start + (i64)FE_CHUNK, d.n);
  const bool vec = aligned4(d.p, sizeof(P)) && aligned4(d.g, sizeof(G)) && aligned4(d.m, 4) &&
                   aligned4(d.v, 4) && (!FE_MASTER || aligned4(d.master, 4));
  i64 i0 = start;
  if (vec) {
    const i64 nv = (end - start) / 4;  // whole 4-element groups in this chunk
    for (i64 k = threadIdx.x; k < nv; k += blockDim.x) {
      const i64 i = start + 4 * k;
      const Pack4<G> gg = *reinterpret_cast<const Pack4<G>*>(g + i);
      Pack4<float> mm = *reinterpret_cast<const Pack4<float>*>(m + i);
      Pack4<float> vv = *reinterpret_cast<const Pack4<float>*>(v + i);
      Pack4<float> pf;
      if (FE_MASTER) {
        pf = *reinterpret_cast<const Pack4<float>*>(master + i);
      } else {
        const Pack4<P> pp = *reinterpret_cast<const Pack4<P>*>(p + i);
#pragma unroll
        for (int e = 0; e < 4; ++e) pf.e[e] = to_float(pp.e[e]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) update(pf.e[e], mm.e[e], vv.e[e], to_float(gg.e[e]), h);
      *reinterpret_cast<Pack4<float>*>(m + i) = mm;
      *reinterpret_cast<Pack4<float>*>(v + i) = vv;
      if (FE_MASTER) *reinterpret_cast<Pack4<float>*>(master + i) = pf;
      Pack4<P> po;
#pragma unroll
      for (int e = 0; e < 4; ++e) po.e[e] = from_float<P>(pf.e[e]);
      *reinterpret_cast<Pack4<P>*>(p + i) = po;
    }
    i0 = start + 4 * nv;
  }
  for (i64 i = i0 + threadIdx.x; i < end; i += blockDim.x) update_one(p, g, m, v, master, i, h);
}
