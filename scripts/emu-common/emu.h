// Host emulation of the CUDA features ferrite's tensor-core kernels use, shared by
// scripts/flash-emu and scripts/mma-emu (each adds a small header of kernel-specific wrappers).
// Every thread of a block is an OS thread; __syncthreads is a block barrier; ldmatrix, mma and
// shfl exchange lane data through a per-warp barrier, so a warp-collective op needs all 32 lanes
// (as `.sync.aligned` does on the GPU). Blocks run one after another (emu_launch).
//
// What it models: the index math, the lane ↔ fragment mapping of ldmatrix (x4, .trans) and
// mma.sync (m16n8k16 f16/bf16, m16n8k8 tf32, fp32 accumulators), 16-bit rounding (RNE),
// cvt.rna.tf32, cp.async commit/wait_group accounting (EMU_CP_ASYNC_LAZY=1: a copy lands only
// when a wait_group retires its group, so a read before the right wait sees the poison), shared
// memory poisoned with 0xff bytes (NaN in every element type), and 2/4/8/16-byte vector accesses
// through the types below, which carry CUDA's alignment (build with -fsanitize=alignment to trap
// a misaligned one, as the GPU would). What it does not: timing, the memory model, SFU
// approximations (run.sh tolerances cover them), accumulation order inside an mma.
#pragma once
#include <math.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __host__
#define __launch_bounds__(...)
#define __align__(x)
// A static __shared__ array is one per process: shared by the block's threads, and blocks run one
// after another (emu_launch), so it models one block's array.
#define __shared__ static

struct Dim { unsigned x, y, z; };
inline thread_local Dim threadIdx, blockIdx;
inline Dim gridDim, blockDim;
inline thread_local unsigned char* g_smem;  // the running block's dynamic shared memory
inline size_t g_smem_bytes;

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
[[noreturn]] inline void __trap() { fprintf(stderr, "__trap() in block (%u,%u,%u) thread %u\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x); abort(); }
template <class A, class B> inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> inline auto max(A a, B b) { return a > b ? a : b; }
// SFU intrinsics as their exact counterparts (see the header comment).
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }

// ---- 16-bit types and conversions (round to nearest even, as the _rn intrinsics) -------------
struct __nv_bfloat16 { uint16_t x; };
struct __half { uint16_t x; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
struct alignas(4) __half2 { __half x, y; };
inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0; u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }
inline float h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
inline uint16_t f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
inline float __bfloat162float(__nv_bfloat16 x) { return bf2f(x.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {f2bf(f)}; }
inline float __half2float(__half x) { return h2f(x.x); }
inline __half __float2half_rn(float f) { return {f2h(f)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {bf2f(v.x.x), bf2f(v.y.x)}; }
inline float2 __half22float2(__half2 v) { return {h2f(v.x.x), h2f(v.y.x)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {{f2bf(a)}, {f2bf(b)}}; }
inline __half2 __floats2half2_rn(float a, float b) { return {{f2h(a)}, {f2h(b)}}; }
// cvt.rna.tf32.f32: 10 mantissa bits, nearest with ties away from zero; NaN/Inf kept.
inline unsigned emu_tf32(unsigned u) {
  if ((u & 0x7f800000) == 0x7f800000) return u;
  return (u + 0x1000) & 0xffffe000u;
}

// A misaligned vector access faults on the GPU: trap it here too (the plain typed accesses are
// checked by -fsanitize=alignment).
inline void emu_check_align(const void* p, size_t a, const char* what) {
  if ((uintptr_t)p % a) { fprintf(stderr, "misaligned %s (%zu bytes) at %p, block (%u,%u,%u) thread %u\n", what, a, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x); abort(); }
}
template <class X> inline X __ldg(const X* p) { emu_check_align(p, alignof(X), "__ldg"); return *p; }

// Entry counts of the functions extract.py --count instruments (one per thread per call).
inline std::atomic<long> emu_hits[8];

// ---- warps ----------------------------------------------------------------------------------
struct Warp {
  std::barrier<>* bar;
  unsigned addr[32];
  unsigned a[32][4], b[32][2];
  float c[32][4];
  float sh[32];
};
inline thread_local Warp* g_warp;
inline std::barrier<>* g_block_bar;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline int lane_id() { return threadIdx.x & 31; }

// ---- shared memory --------------------------------------------------------------------------
inline unsigned smem_u32(const void* p) {
  const unsigned char* c = (const unsigned char*)p;
  if (c < g_smem || c >= g_smem + g_smem_bytes) { fprintf(stderr, "shared address %p outside the block's %zu bytes\n", p, g_smem_bytes); abort(); }
  return (unsigned)(c - g_smem);
}
inline unsigned char* emu_smem_at(unsigned a, unsigned bytes) {
  if ((size_t)a + bytes > g_smem_bytes) { fprintf(stderr, "shared access [%u, +%u) past the block's %zu bytes\n", a, bytes, g_smem_bytes); abort(); }
  return g_smem + a;
}
inline uint16_t sh16(unsigned a) { uint16_t v; memcpy(&v, emu_smem_at(a, 2), 2); return v; }
inline void sts32(unsigned a, unsigned x) { memcpy(emu_smem_at(a, 4), &x, 4); }

// cp.async of 16 bytes: the first `valid` bytes from global, the rest zero (src-size semantics).
// EMU_CP_ASYNC_LAZY=0: copied at once; 1: held in the thread's open group until commit, and the
// group lands only when a wait_group leaves fewer than it pending.
#ifndef EMU_CP_ASYNC_LAZY
#define EMU_CP_ASYNC_LAZY 0
#endif
struct EmuCopy { unsigned dst; const unsigned char* src; int valid; };
inline thread_local std::vector<EmuCopy> emu_cp_open;
inline thread_local std::vector<std::vector<EmuCopy>> emu_cp_groups;
inline void emu_cp_do(const EmuCopy& c) {
  unsigned char* d = emu_smem_at(c.dst, 16);
  if (c.valid) memcpy(d, c.src, c.valid);
  memset(d + c.valid, 0, 16 - c.valid);
}
inline void emu_cp_async16(unsigned s, const void* g, int valid) {
  emu_check_align(g_smem + s, 16, "cp.async shared destination");
  if (valid) emu_check_align(g, 16, "cp.async global source");
  EmuCopy c{s, (const unsigned char*)g, valid};
  if (EMU_CP_ASYNC_LAZY) emu_cp_open.push_back(c); else emu_cp_do(c);
}
inline void emu_cp_commit() {
  emu_cp_groups.push_back(std::move(emu_cp_open));
  emu_cp_open.clear();
}
inline void emu_cp_wait(int n) {
  while ((int)emu_cp_groups.size() > n) {
    for (auto& c : emu_cp_groups.front()) emu_cp_do(c);
    emu_cp_groups.erase(emu_cp_groups.begin());
  }
}

// ---- ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 ---------------------------------------
// Lanes 8i..8i+7 address the rows of matrix i; lane L receives r[i] = elements (L/4, 2(L%4)..+1)
// of matrix i, or with .trans elements (2(L%4)..+1, L/4).
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

// ---- mma.sync.aligned ------------------------------------------------------------------------
// Lane L = 4g + t holds accumulators d0,d1 = (row g, cols 2t, 2t+1), d2,d3 = (row g+8, same).
// EMU_KIND_F16 / BF16: m16n8k16, a0 = A(g, 2t..+1), a1 = A(g+8, 2t..), a2 = A(g, 2t+8..),
// a3 = A(g+8, 2t+8..); b0 = B(2t..+1, g), b1 = B(2t+8.., g). EMU_KIND_TF32: m16n8k8, a0 = A(g, t),
// a1 = A(g+8, t), a2 = A(g, t+4), a3 = A(g+8, t+4); b0 = B(t, g), b1 = B(t+4, g); the low 13 bits
// of each operand are ignored (the kernel rounds them away with cvt.rna first).
enum { EMU_KIND_F16 = 0, EMU_KIND_BF16 = 1, EMU_KIND_TF32 = 2 };
template <int KIND>
inline void emu_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  constexpr int K = KIND == EMU_KIND_TF32 ? 8 : 16;
  Warp* w = g_warp; int L = lane_id();
  for (int i = 0; i < 4; ++i) { w->a[L][i] = a[i]; w->c[L][i] = d[i]; }
  w->b[L][0] = b0; w->b[L][1] = b1;
  w->bar->arrive_and_wait();
  float A[16][16], B[16][8];
  auto e = [](unsigned u, int h) { uint16_t x = h ? u >> 16 : u & 0xffff; return KIND == EMU_KIND_BF16 ? bf2f(x) : h2f(x); };
  for (int l = 0; l < 32; ++l) {
    int g = l >> 2, t = l & 3;
    if (KIND == EMU_KIND_TF32) {
      auto f = [](unsigned u) { return __uint_as_float(u & 0xffffe000u); };
      A[g][t] = f(w->a[l][0]); A[g + 8][t] = f(w->a[l][1]);
      A[g][t + 4] = f(w->a[l][2]); A[g + 8][t + 4] = f(w->a[l][3]);
      B[t][g] = f(w->b[l][0]); B[t + 4][g] = f(w->b[l][1]);
    } else {
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = e(w->a[l][0], h); A[g + 8][2 * t + h] = e(w->a[l][1], h);
        A[g][2 * t + 8 + h] = e(w->a[l][2], h); A[g + 8][2 * t + 8 + h] = e(w->a[l][3], h);
        B[2 * t + h][g] = e(w->b[l][0], h); B[2 * t + 8 + h][g] = e(w->b[l][1], h);
      }
    }
  }
  int g = L >> 2, t = L & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float acc = w->c[L][i];
    for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
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

inline int __any_sync(unsigned, int pred) {
  Warp* w = g_warp; int L = lane_id();
  w->sh[L] = pred ? 1.f : 0.f; w->bar->arrive_and_wait();
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= w->sh[l] != 0.f;
  w->bar->arrive_and_wait();
  return any;
}

// ---- launch -----------------------------------------------------------------------------------
// Runs `f` (the kernel call) for every block of `grid`, nt threads each, with `smem_bytes` of
// dynamic shared memory poisoned with 0xff. Blocks run one after another.
inline void emu_launch(Dim grid, int nt, size_t smem_bytes, std::function<void()> f) {
  gridDim = grid; blockDim = {(unsigned)nt, 1, 1};
  std::vector<unsigned char> smem(smem_bytes ? smem_bytes : 1);
  g_smem_bytes = smem_bytes;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        memset(smem.data(), 0xff, smem.size());
        std::barrier<> bb(nt);
        std::vector<Warp> warps(nt / 32);
        for (auto& w : warps) w.bar = new std::barrier<>(32);
        g_block_bar = &bb;
        std::atomic<int> leftover{0};
        std::vector<std::thread> th;
        for (int i = 0; i < nt; ++i)
          th.emplace_back([&, i] {
            threadIdx = {(unsigned)i, 0, 0}; blockIdx = {x, y, z};
            g_smem = smem.data(); g_warp = &warps[i / 32];
            emu_cp_open.clear(); emu_cp_groups.clear();
            f();
            size_t left = emu_cp_open.size();
            for (auto& g : emu_cp_groups) left += g.size();
            if (left) leftover += (int)left;
          });
        for (auto& t : th) t.join();
        for (auto& w : warps) delete w.bar;
        // Legal on the GPU (the copies land anyway) but never needed by these kernels: report it.
        if (leftover) fprintf(stderr, "note: %d cp.async copies never waited for in block (%u,%u,%u)\n", leftover.load(), x, y, z);
      }
}
