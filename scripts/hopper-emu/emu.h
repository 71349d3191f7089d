// Host versions of kernels/hopper.cu's PTX wrappers (attention `hopper`, sm_90a), on
// scripts/emu-common/emu.h: mbarriers (arrival counts, transaction bytes, phase parity), TMA 4-D
// tile loads into 128-byte-swizzled shared memory (zero fill outside the tensor), wgmma
// (warpgroup-collective, operands read from shared memory through their matrix descriptors, or A
// from registers), named barriers, red.global. bf16 only (the driver builds bf16 inputs).
//
// The descriptor and swizzle rules modelled (PTX ISA, "matrix descriptor", 128-byte swizzle,
// 16-bit elements): a linear address is formed, then bits [4:6] are XORed with bits [7:9].
//   K-major operand (rows of M or N, 64 elements of K per 128-byte row):
//     addr(r, k) = start + (r / 8)·SBO + (r % 8)·128 + 2k
//   MN-major operand (rows of K, 64 elements of M or N per 128-byte row):
//     addr(k, x) = start + (x / 64)·LBO + (k / 8)·SBO + (k % 8)·128 + 2·(x % 64)
// The forward kernel (checked on the H100) uses K-major A and B and MN-major B; the driver runs it
// first, so those rules are validated against the hardware through it. MN-major A (the
// backward's dQ product) follows the same rule by symmetry, an assumption until a GPU check.
//
// Everything runs synchronously: a wgmma completes at issue, a TMA copy at issue (before its
// bytes are counted on the barrier). What this cannot see: ordering bugs between wgmma and the
// registers or shared memory it uses (the GPU's asynchrony), timing.
#pragma once
#include <condition_variable>
#include <map>
#include <mutex>

#include "../emu-common/emu.h"

#define __grid_constant__

// ---- per-block state (reset by hopper_launch) ------------------------------------------------
struct EmuMbar {
  int count = 0, pending = 0;
  long tx = 0;
  unsigned phase = 0;  // completed phases
};
struct EmuNamedBar {
  int arrived = 0;
  unsigned gen = 0;
};
struct EmuWgSlot {
  std::barrier<>* bar;
  unsigned long long da[128], db[128];
  unsigned a[128][4];
  int scale[128];
};
inline std::mutex g_hop_mu;
inline std::condition_variable g_hop_cv;
inline std::map<unsigned, EmuMbar>* g_mbars;
inline EmuNamedBar g_named[16];
inline EmuWgSlot* g_wgs;  // one per warpgroup of the block

inline void emu_mbar_try_complete(EmuMbar& b) {
  if (b.pending == 0 && b.tx == 0) {
    b.phase++;
    b.pending = b.count;
    g_hop_cv.notify_all();
  }
}
inline EmuMbar& emu_mbar(unsigned a) {
  auto it = g_mbars->find(a);
  if (it == g_mbars->end()) { fprintf(stderr, "mbarrier at %u used before init\n", a); abort(); }
  return it->second;
}
inline void mbar_init(unsigned bar, unsigned count) {
  std::lock_guard<std::mutex> l(g_hop_mu);
  EmuMbar b;
  b.count = b.pending = (int)count;
  (*g_mbars)[bar] = b;
}
inline void mbar_arrive(unsigned bar) {
  std::lock_guard<std::mutex> l(g_hop_mu);
  EmuMbar& b = emu_mbar(bar);
  if (--b.pending < 0) { fprintf(stderr, "mbarrier %u: more arrivals than its count\n", bar); abort(); }
  emu_mbar_try_complete(b);
}
inline void mbar_expect_tx(unsigned bar, unsigned bytes) {
  std::lock_guard<std::mutex> l(g_hop_mu);
  EmuMbar& b = emu_mbar(bar);
  b.tx += bytes;
  if (--b.pending < 0) { fprintf(stderr, "mbarrier %u: more arrivals than its count\n", bar); abort(); }
  emu_mbar_try_complete(b);
}
inline void emu_mbar_complete_tx(unsigned bar, unsigned bytes) {
  std::lock_guard<std::mutex> l(g_hop_mu);
  EmuMbar& b = emu_mbar(bar);
  b.tx -= bytes;
  if (b.tx < 0) { fprintf(stderr, "mbarrier %u: more bytes than expected\n", bar); abort(); }
  emu_mbar_try_complete(b);
}
// try_wait.parity P succeeds once the phase of parity P has completed: with n phases completed,
// when n % 2 != P (a fresh barrier counts as having completed the phase of parity 1).
inline void mbar_wait(unsigned bar, unsigned parity) {
  std::unique_lock<std::mutex> l(g_hop_mu);
  g_hop_cv.wait(l, [&] { return (emu_mbar(bar).phase & 1) != (parity & 1); });
}
inline void fence_barrier_init() {}
inline void fence_async_smem() {}
template <int N> inline void regs_dec() {}
template <int N> inline void regs_inc() {}
inline void named_arrive(int id, int n) {
  std::lock_guard<std::mutex> l(g_hop_mu);
  EmuNamedBar& b = g_named[id];
  if (++b.arrived == n) { b.arrived = 0; b.gen++; g_hop_cv.notify_all(); }
}
inline void named_sync(int id, int n) {
  std::unique_lock<std::mutex> l(g_hop_mu);
  EmuNamedBar& b = g_named[id];
  const unsigned gen = b.gen;
  if (++b.arrived == n) { b.arrived = 0; b.gen++; g_hop_cv.notify_all(); return; }
  g_hop_cv.wait(l, [&] { return b.gen != gen; });
}
inline void __syncwarp() { g_warp->bar->arrive_and_wait(); }
inline int __all_sync(unsigned, int p) {
  Warp* w = g_warp; int L = lane_id();
  w->sh[L] = p ? 1.f : 0.f; w->bar->arrive_and_wait();
  int all = 1;
  for (int i = 0; i < 32; ++i) all &= w->sh[i] != 0.f;
  w->bar->arrive_and_wait();
  return all;
}

// ---- TMA: the driver encodes an EmuMap into the kernel's 128-byte TmaDesc ---------------------
struct EmuMap {
  const unsigned char* ptr;
  unsigned long long dims[4];      // elements; dim 0 is d (contiguous)
  unsigned long long strides[3];   // bytes, of dims 1..3
  unsigned box[4];  // box[0] = 64 (128 bytes), one of box[1..3] = rows, the others 1
};
static_assert(sizeof(EmuMap) <= 128, "fits a CUtensorMap");
inline unsigned emu_swz(unsigned a) { return a ^ (((a >> 7) & 7) << 4); }
template <class Desc>
inline void tma_load4(unsigned dst, const Desc* map, unsigned bar, int d0, const int (&c)[3]) {
  EmuMap m;
  memcpy(&m, map, sizeof m);
  if (dst % 1024) { fprintf(stderr, "TMA destination %u not 1024-aligned (128B swizzle)\n", dst); abort(); }
  if (m.box[0] != 64) { fprintf(stderr, "TMA box of %u elements along d (swizzle row is 64)\n", m.box[0]); abort(); }
  unsigned r = 0;
  for (unsigned i3 = 0; i3 < m.box[3]; ++i3)
    for (unsigned i2 = 0; i2 < m.box[2]; ++i2)
      for (unsigned i1 = 0; i1 < m.box[1]; ++i1, ++r) {
        const long x1 = c[0] + (long)i1, x2 = c[1] + (long)i2, x3 = c[2] + (long)i3;
        const bool in = x1 >= 0 && x2 >= 0 && x3 >= 0 && (unsigned long long)x1 < m.dims[1] && (unsigned long long)x2 < m.dims[2] &&
                        (unsigned long long)x3 < m.dims[3];
        for (unsigned e = 0; e < 64; ++e) {
          const long x0 = d0 + (long)e;
          uint16_t v = 0;
          if (in && x0 >= 0 && (unsigned long long)x0 < m.dims[0])
            memcpy(&v, m.ptr + x1 * m.strides[0] + x2 * m.strides[1] + x3 * m.strides[2] + 2 * x0, 2);
          memcpy(emu_smem_at(emu_swz(dst + r * 128 + 2 * e), 2), &v, 2);
        }
      }
  emu_mbar_complete_tx(bar, r * 128);
}

// ---- wgmma -------------------------------------------------------------------------------------
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N> inline void wgmma_wait() {}
template <int N> inline void acc_fence(float (&)[N]) {}

struct EmuDesc { unsigned start, lbo, sbo; };
inline EmuDesc emu_desc(unsigned long long d) {
  if ((d >> 62) != 1) { fprintf(stderr, "descriptor without 128B swizzle: %llx\n", (unsigned long long)d); abort(); }
  return {(unsigned)(d & 0x3FFF) << 4, (unsigned)((d >> 16) & 0x3FFF) << 4, (unsigned)((d >> 32) & 0x3FFF) << 4};
}
inline float emu_bf(unsigned a) { return bf2f(sh16(emu_swz(a))); }
// Element (row, k) of a K-major operand / (k, x) of an MN-major one.
inline float emu_kmajor(const EmuDesc& d, int r, int k) { return emu_bf(d.start + (r / 8) * d.sbo + (r % 8) * 128 + 2 * k); }
inline float emu_mnmajor(const EmuDesc& d, int k, int x) {
  return emu_bf(d.start + (x / 64) * d.lbo + (k / 8) * d.sbo + (k % 8) * 128 + 2 * (x % 64));
}

// One m64nNk16 for the calling warpgroup: A from shared memory (ta: MN-major) or, when a is
// non-null, from every thread's A fragment; B from shared memory (tb: MN-major). Each thread
// updates its own accumulators (d[4j + e] = row 16·warp + g + 8(e/2), col 8j + 2t + e%2).
template <int N>
inline void emu_wgmma(float* d, unsigned long long da, unsigned long long db, int scale_d, const unsigned* a, bool ta, bool tb) {
  const int tid = threadIdx.x % 128;
  EmuWgSlot& w = g_wgs[threadIdx.x / 128];
  w.da[tid] = da; w.db[tid] = db; w.scale[tid] = scale_d;
  if (a) for (int i = 0; i < 4; ++i) w.a[tid][i] = a[i];
  w.bar->arrive_and_wait();
  for (int i = 0; i < 128; ++i)
    if (w.db[i] != db || (!a && w.da[i] != da) || w.scale[i] != scale_d) {
      fprintf(stderr, "wgmma: thread %d of the warpgroup passed other descriptors than thread %d\n", i, tid); abort();
    }
  const int warp = tid / 32, L = tid % 32, g = L >> 2, t = L & 3;
  float A[2][16];  // this thread's two rows of A
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * warp + g + 8 * h;
    for (int k = 0; k < 16; ++k) {
      if (a) {
        // Register A: lane 4g'+t' of the row's warp holds (g', 2t'..), (g'+8, ..), (g', 2t'+8..), (g'+8, 2t'+8..).
        const int gl = row % 16 % 8, hl = row % 16 / 8, tl = (k % 8) / 2, reg = hl + 2 * (k / 8);
        const unsigned u = w.a[warp * 32 + gl * 4 + tl][reg];
        A[h][k] = bf2f((k % 2) ? u >> 16 : u & 0xffff);
      } else {
        const EmuDesc e = emu_desc(da);
        A[h][k] = ta ? emu_mnmajor(e, k, row) : emu_kmajor(e, row, k);
      }
    }
  }
  const EmuDesc eb = emu_desc(db);
  float out[N / 2];
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1, col = 8 * j + 2 * t + (e & 1);
      float acc = scale_d ? d[4 * j + e] : 0.f;
      for (int k = 0; k < 16; ++k) acc += A[h][k] * (tb ? emu_mnmajor(eb, k, col) : emu_kmajor(eb, col, k));
      out[4 * j + e] = acc;
    }
  w.bar->arrive_and_wait();
  for (int i = 0; i < N / 2; ++i) d[i] = out[i];
}
inline void wgmma_ss_n128(float (&d)[64], unsigned long long da, unsigned long long db, int s) { emu_wgmma<128>(d, da, db, s, nullptr, false, false); }
inline void wgmma_ss_n64(float (&d)[32], unsigned long long da, unsigned long long db, int s) { emu_wgmma<64>(d, da, db, s, nullptr, false, false); }
inline void wgmma_ss_tt_n64(float (&d)[32], unsigned long long da, unsigned long long db, int s) { emu_wgmma<64>(d, da, db, s, nullptr, true, true); }
inline void wgmma_ss_tt_n32(float (&d)[16], unsigned long long da, unsigned long long db, int s) { emu_wgmma<32>(d, da, db, s, nullptr, true, true); }
inline void wgmma_rs_n128(float (&d)[64], const unsigned (&a)[4], unsigned long long db) { emu_wgmma<128>(d, 0, db, 1, a, false, true); }
inline void wgmma_rs_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long db) { emu_wgmma<64>(d, 0, db, 1, a, false, true); }

// ---- the rest ----------------------------------------------------------------------------------
inline float ex2_approx(float x) { return exp2f(x); }
inline float tanh_approx(float x) { return tanhf(x); }
inline void red_add2(float* p, float x, float y) {
  emu_check_align(p, 8, "red.global.add.v2.f32");
  std::atomic_ref<float>(p[0]).fetch_add(x);
  std::atomic_ref<float>(p[1]).fetch_add(y);
}
inline float2 lds_f2(unsigned a) {
  if (a % 8) { fprintf(stderr, "misaligned ld.shared.v2.f32 at %u\n", a); abort(); }
  float2 v; memcpy(&v, emu_smem_at(a, 8), 8); return v;
}
inline void sts_u32(unsigned a, unsigned v) {
  if (a % 4) { fprintf(stderr, "misaligned st.shared.u32 at %u\n", a); abort(); }
  sts32(a, v);
}

// Runs `f` for every block of `grid` (nt threads, nt / 128 warpgroups), one block after another,
// with fresh mbarriers and named barriers and shared memory poisoned with 0xff.
inline void hopper_launch(Dim grid, int nt, size_t smem_bytes, std::function<void()> f) {
  std::map<unsigned, EmuMbar> mbars;
  std::vector<EmuWgSlot> wgs(nt / 128);
  for (auto& w : wgs) w.bar = new std::barrier<>(128);
  g_wgs = wgs.data();
  // emu_launch runs each block afresh; the mbarrier table and named barriers are per block.
  unsigned last = ~0u;
  emu_launch(grid, nt, smem_bytes, [&] {
    const unsigned id = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    {
      std::lock_guard<std::mutex> l(g_hop_mu);
      if (id != last) {
        last = id;
        mbars.clear();
        for (auto& n : g_named) n = EmuNamedBar{};
        g_mbars = &mbars;
      }
    }
    f();
  });
  for (auto& w : wgs) delete w.bar;
}
