// Host emulation of the CUDA the row kernels use (activation, norm, cross_entropy; see run.sh).
// Same idea as ../flash-emu/emu.h (every thread of a block an OS thread, __syncthreads a block
// barrier, shuffles through a warp barrier), extended for these kernels: bf16/f16 conversions,
// shuffles of any 4/8-byte type, static shared memory per block (extract.py turns
// `__shared__ T a[n];` into EMU_SHARED), dynamic shared memory with a guard band, cp.async as a
// per-thread queue of copies that land eagerly (at issue) or lazily (at the wait that must see
// them), ex2/rcp.approx.ftz through libm, __umulhi. Launches of kernels without barriers or
// shuffles can run their threads one after another on the calling thread (a barrier or shuffle
// there aborts).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
using std::isnan;  // CUDA's isnan is global; the kernels call it unqualified
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

namespace ferrite {
typedef long long i64;
typedef unsigned long long u64;
}  // namespace ferrite

#define __device__
#define __global__
#define __forceinline__ inline
#define __host__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(x) alignas(x)

[[noreturn]] inline void emu_die(const char* what) {
  fprintf(stderr, "EMU ERROR: %s\n", what);
  fflush(stderr);
  abort();
}

struct Dim {
  unsigned x, y, z;
};
inline thread_local Dim threadIdx, blockIdx;
inline Dim gridDim, blockDim;

struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, 4);
  return f;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }

// 16-bit storage types and their round-to-nearest-even conversions.
struct __nv_bfloat16 {
  uint16_t x;
};
struct __half {
  uint16_t x;
};
inline uint32_t emu_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float emu_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline float __bfloat162float(__nv_bfloat16 h) { return emu_float((uint32_t)h.x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = emu_bits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return {(uint16_t)((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return {(uint16_t)(u >> 16)};
}
inline float __half2float(__half h) {
  const uint32_t s = (uint32_t)(h.x & 0x8000) << 16, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff;
  if (e == 0x1f) return emu_float(s | 0x7f800000 | (m << 13));
  if (e == 0) return (s ? -1.f : 1.f) * ldexpf((float)m, -24);
  return emu_float(s | ((e + 112) << 23) | (m << 13));
}
inline __half __float2half_rn(float f) {
  const uint32_t u = emu_bits(f), s = (u >> 16) & 0x8000;
  const float a = fabsf(f);
  if (std::isnan(f)) return {(uint16_t)(s | 0x7e00)};
  if (a >= 65520.f) return {(uint16_t)(s | 0x7c00)};  // rounds to inf
  if (a < ldexpf(1.f, -14)) {                          // subnormal: multiples of 2^-24, RNE
    const float q = nearbyintf(ldexpf(a, 24));         // default rounding mode: to nearest even
    return {(uint16_t)(s | (uint32_t)q)};
  }
  uint32_t v = emu_bits(a);
  v += 0xfff + ((v >> 13) & 1);
  const uint32_t e = (v >> 23) - 112, m = (v >> 13) & 0x3ff;
  return {(uint16_t)(s | (e << 10) | m)};
}

// The special-function unit: .approx.ftz results (subnormal inputs and results flushed to 0);
// the emulation computes them with libm (the hardware's ≤ 2⁻²² relative error is not modelled).
inline float emu_ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? copysignf(0.f, x) : x; }
// In namespace ferrite, as sfu.cuh declares them (act.cuh calls them qualified).
namespace ferrite {
inline float ex2_approx(float x) { return emu_ftz(exp2f(emu_ftz(x))); }
inline float rcp_approx(float x) { return emu_ftz(1.f / emu_ftz(x)); }
}  // namespace ferrite

// ------------------------------------------------------------------------ blocks and warps ----

struct EmuWarp {
  std::barrier<>* bar = nullptr;
  uint64_t slot[32];
};

struct EmuBlock {
  std::barrier<>* bar = nullptr;  // null: a sequential launch (no barriers allowed)
  EmuWarp* warps = nullptr;
  unsigned char* stat = nullptr;  // static shared memory
  size_t stat_cap = 0;
  unsigned char* dyn = nullptr;  // dynamic shared memory
  size_t dyn_bytes = 0;
};

inline thread_local EmuBlock* g_blk;
inline thread_local EmuWarp* g_warp;
inline thread_local size_t g_stat_off;

inline unsigned emu_tid() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

inline void __syncthreads() {
  if (!g_blk->bar) emu_die("__syncthreads in a launch run sequentially");
  g_blk->bar->arrive_and_wait();
}

template <class V>
inline V __shfl_xor_sync(unsigned mask, V v, int m) {
  static_assert(sizeof(V) <= 8, "4- or 8-byte shuffles");
  if (mask != 0xffffffffu) emu_die("shuffle with a partial mask");
  if (!g_warp || !g_warp->bar) emu_die("shuffle in a launch run sequentially");
  const int L = emu_tid() & 31;
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(V));
  g_warp->slot[L] = u;
  g_warp->bar->arrive_and_wait();
  const uint64_t r = g_warp->slot[L ^ m];
  g_warp->bar->arrive_and_wait();
  V out;
  memcpy(&out, &r, sizeof(V));
  return out;
}

// `__shared__ T name[dims];` (extract.py): every thread of the block declares the same arrays in
// the same order, so a per-thread bump offset into the block's static area gives all of them the
// same address.
inline void* emu_shared_alloc(size_t bytes, size_t align) {
  const size_t off = (g_stat_off + align - 1) / align * align;
  g_stat_off = off + bytes;
  if (g_stat_off > g_blk->stat_cap) emu_die("static shared memory over 48 KiB");
  return g_blk->stat + off;
}
#define EMU_SHARED(TY, NAME, DIMS) \
  auto& NAME = *reinterpret_cast<TY(*) DIMS>(emu_shared_alloc(sizeof(TY DIMS), alignof(TY)))

// ---------------------------------------------------------------------------------- cp.async ----

// Eager: each copy lands when issued. Lazy: it lands at the latest moment the program may rely
// on (the cp.async.wait_group that retires its group). A correct kernel gives the same result
// either way; reading a stage before its copy landed shows up lazily, overwriting a stage still
// to be read shows up eagerly.
enum class CpMode { Eager, Lazy };
inline CpMode g_cp_mode = CpMode::Lazy;
struct EmuCopy {
  void* dst;
  const void* src;
};
struct EmuCpState {
  std::vector<EmuCopy> open;
  std::deque<std::vector<EmuCopy>> groups;
};
inline thread_local EmuCpState g_cp;

inline void emu_cp16(void* dst, const void* src) {
  unsigned char* d = (unsigned char*)dst;
  if (!g_blk->dyn || d < g_blk->dyn || d + 16 > g_blk->dyn + g_blk->dyn_bytes)
    emu_die("cp.async outside the dynamic shared memory");
  if (((uintptr_t)d & 15) || ((uintptr_t)src & 15)) emu_die("cp.async of 16 bytes misaligned");
  if (g_cp_mode == CpMode::Eager)
    memcpy(dst, src, 16);
  else
    g_cp.open.push_back({dst, src});
}
inline void emu_cp_commit() {
  g_cp.groups.push_back(std::move(g_cp.open));
  g_cp.open.clear();
}
inline void emu_cp_wait(int n) {
  if (!g_cp.open.empty()) emu_die("cp.async.wait_group with uncommitted copies");
  while ((int)g_cp.groups.size() > n) {
    for (auto& c : g_cp.groups.front()) memcpy(c.dst, c.src, 16);
    g_cp.groups.pop_front();
  }
}

// --------------------------------------------------------------------------------- launches ----

struct EmuLaunch {
  Dim grid, block;
  size_t dyn_smem = 0;
  bool sequential = false;  // no barriers/shuffles: run the threads one by one
};

constexpr size_t EMU_STATIC_CAP = 48 * 1024;
constexpr size_t EMU_GUARD = 4096;

// Runs `body` as the kernel over the grid, blocks one after another. Shared memory is poisoned
// (0xff: NaN in every float type) per block; the dynamic area's guard band is checked after.
inline void emu_launch(const EmuLaunch& L, const std::function<void()>& body) {
  gridDim = L.grid;
  blockDim = L.block;
  const unsigned nt = L.block.x * L.block.y * L.block.z;
  if (nt == 0 || nt > 1024 || nt % 32) emu_die("block size must be a multiple of 32, ≤ 1024");
  if (L.dyn_smem + 0 > 232448) emu_die("dynamic shared memory over the H100's 227 KiB opt-in");
  std::vector<unsigned char> stat(EMU_STATIC_CAP), dyn(L.dyn_smem + EMU_GUARD + 16);
  unsigned char* dyn_base = dyn.data() + ((16 - ((uintptr_t)dyn.data() & 15)) & 15);
  for (unsigned bz = 0; bz < L.grid.z; ++bz)
    for (unsigned by = 0; by < L.grid.y; ++by)
      for (unsigned bx = 0; bx < L.grid.x; ++bx) {
        memset(stat.data(), 0xff, stat.size());
        memset(dyn_base, 0xff, L.dyn_smem);
        memset(dyn_base + L.dyn_smem, 0x5a, EMU_GUARD);
        EmuBlock blk;
        blk.stat = stat.data();
        blk.stat_cap = stat.size();
        blk.dyn = L.dyn_smem ? dyn_base : nullptr;
        blk.dyn_bytes = L.dyn_smem;
        std::vector<EmuWarp> warps(nt / 32);
        blk.warps = warps.data();
        auto thread_main = [&](unsigned t) {
          threadIdx = {t % L.block.x, (t / L.block.x) % L.block.y, t / (L.block.x * L.block.y)};
          blockIdx = {bx, by, bz};
          g_blk = &blk;
          g_warp = &warps[t / 32];
          g_stat_off = 0;
          g_cp.open.clear();
          g_cp.groups.clear();
          body();
          // A real block may not exit with copies in flight into shared memory.
          bool pending = !g_cp.open.empty();
          for (auto& g : g_cp.groups) pending |= !g.empty();
          if (pending) emu_die("thread exited with cp.async copies in flight");
          // An exited thread no longer counts at the block's or its warp's barriers.
          if (blk.bar) blk.bar->arrive_and_drop();
          if (g_warp->bar) g_warp->bar->arrive_and_drop();
        };
        if (L.sequential) {
          for (unsigned t = 0; t < nt; ++t) thread_main(t);
        } else {
          std::barrier<> bb(nt);
          blk.bar = &bb;
          std::vector<std::barrier<>*> wb;
          for (auto& w : warps) w.bar = new std::barrier<>(32);
          std::vector<std::thread> th;
          th.reserve(nt);
          for (unsigned t = 0; t < nt; ++t) th.emplace_back(thread_main, t);
          for (auto& t : th) t.join();
          for (auto& w : warps) delete w.bar;
        }
        for (size_t i = 0; i < EMU_GUARD; ++i)
          if (dyn_base[L.dyn_smem + i] != 0x5a) emu_die("write past the dynamic shared memory");
      }
}

// ------------------------------------------------------------------ global memory for drivers ----

// A device buffer: 256-byte aligned (as cudaMalloc), guard bands either side checked by check().
struct EmuBuf {
  std::vector<unsigned char> mem;
  size_t bytes = 0, off = 0;
  EmuBuf() = default;
  explicit EmuBuf(size_t n, unsigned char fill = 0xff) { alloc(n, fill); }
  void alloc(size_t n, unsigned char fill = 0xff) {
    bytes = n;
    mem.assign(n + 3 * EMU_GUARD, 0x5a);
    off = EMU_GUARD + ((256 - ((uintptr_t)(mem.data() + EMU_GUARD) & 255)) & 255);
    memset(mem.data() + off, fill, n);
  }
  unsigned char* p() { return bytes ? mem.data() + off : nullptr; }
  template <class X>
  X* as() { return reinterpret_cast<X*>(p()); }
  void poison() { memset(p(), 0xff, bytes); }
  bool check() const {
    for (size_t i = 0; i < off; ++i)
      if (mem[i] != 0x5a) return false;
    for (size_t i = off + bytes; i < mem.size(); ++i)
      if (mem[i] != 0x5a) return false;
    return true;
  }
};
