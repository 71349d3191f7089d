// Host emulation of the CUDA features kernels/flash.cu uses (see run.sh): each thread of a block
// is an OS thread, __syncthreads a block barrier, ldmatrix/mma/shfl exchange lanes via a barrier.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
namespace ferrite { typedef long long i64; typedef unsigned long long u64; }
using ferrite::i64;
#define __device__
#define __global__
#define __forceinline__ inline
#define __host__
#define __launch_bounds__(a, b)
#define __align__(x)
struct Dim { unsigned x, y, z; };
extern thread_local Dim threadIdx, blockIdx;
extern Dim gridDim, blockDim;
extern thread_local unsigned char* g_smem;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
struct __nv_bfloat16 { uint16_t x; };
struct __half { uint16_t x; };
template <class A, class B> inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> inline auto max(A a, B b) { return a > b ? a : b; }
inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0; u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }

struct Warp {
  std::barrier<>* bar;
  unsigned addr[32];
  unsigned a[32][4], b[32][2];
  float c[32][4];
  float sh[32];
};
extern thread_local Warp* g_warp;
extern std::barrier<>* g_block_bar;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int lane_id() { return threadIdx.x & 31; }

// Element helpers for T = __nv_bfloat16 (the emulation runs bf16 only).
inline unsigned pack2(float x, float y) { return (unsigned)f2bf(x) | ((unsigned)f2bf(y) << 16); }
inline float2 unpack2(unsigned u) { return {bf2f(u & 0xffff), bf2f(u >> 16)}; }
inline float exp2_fast(float x) { return exp2f(x); }
inline float tanh_fast(float x) { return tanhf(x); }
inline unsigned smem_u32(const void* p) { return (unsigned)((const unsigned char*)p - g_smem); }
inline void cp_async16_s(unsigned s, const void* g, bool valid) {
  if (valid) memcpy(g_smem + s, g, 16); else memset(g_smem + s, 0, 16);
}
inline void cp_async16(void* s, const void* g, bool valid) { cp_async16_s(smem_u32(s), g, valid); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
inline void sts32(unsigned a, unsigned x) { memcpy(g_smem + a, &x, 4); }
inline uint16_t sh16(unsigned a) { uint16_t v; memcpy(&v, g_smem + a, 2); return v; }
inline void ldsm_impl(unsigned (&r)[4], unsigned a, bool trans) {
  Warp* w = g_warp; int L = lane_id();
  w->addr[L] = a;
  w->bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      unsigned row = w->addr[8 * i + L / 4];
      lo = sh16(row + 2 * (2 * (L % 4))); hi = sh16(row + 2 * (2 * (L % 4) + 1));
    } else {
      lo = sh16(w->addr[8 * i + 2 * (L % 4)] + 2 * (L / 4));
      hi = sh16(w->addr[8 * i + 2 * (L % 4) + 1] + 2 * (L / 4));
    }
    r[i] = (unsigned)lo | ((unsigned)hi << 16);
  }
  w->bar->arrive_and_wait();
}
inline void ldsm_x4_s(unsigned (&r)[4], unsigned a) { ldsm_impl(r, a, false); }
inline void ldsm_x4_ts(unsigned (&r)[4], unsigned a) { ldsm_impl(r, a, true); }
inline void ldsm_x4(unsigned (&r)[4], const void* p) { ldsm_impl(r, smem_u32(p), false); }
inline void ldsm_x4_t(unsigned (&r)[4], const void* p) { ldsm_impl(r, smem_u32(p), true); }
inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  Warp* w = g_warp; int L = lane_id();
  for (int i = 0; i < 4; ++i) { w->a[L][i] = a[i]; w->c[L][i] = d[i]; }
  w->b[L][0] = b0; w->b[L][1] = b1;
  w->bar->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    int g = l >> 2, t = l & 3;
    auto e = [&](unsigned u, int h) { return bf2f(h ? u >> 16 : u & 0xffff); };
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = e(w->a[l][0], h); A[g + 8][2 * t + h] = e(w->a[l][1], h);
      A[g][2 * t + 8 + h] = e(w->a[l][2], h); A[g + 8][2 * t + 8 + h] = e(w->a[l][3], h);
      B[2 * t + h][g] = e(w->b[l][0], h); B[2 * t + 8 + h][g] = e(w->b[l][1], h);
    }
  }
  int g = L >> 2, t = L & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float acc = w->c[L][i];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    out[i] = acc;
  }
  w->bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
  Warp* w = g_warp; int L = lane_id();
  w->sh[L] = v; w->bar->arrive_and_wait();
  float r = w->sh[L ^ m]; w->bar->arrive_and_wait();
  return r;
}
inline void red_add2(float* p, float x, float y) {
  std::atomic_ref<float>(p[0]).fetch_add(x);
  std::atomic_ref<float>(p[1]).fetch_add(y);
}
inline float log2f_(float x) { return log2f(x); }
