// The host versions of kernels/flash.cu's PTX wrappers (run.sh), on scripts/emu-common/emu.h.
// bf16 only (the driver builds bf16 inputs; flash.cu's default FE_ELEM).
#pragma once
#include "../emu-common/emu.h"

inline void cp_async16_s(unsigned s, const void* g, bool valid) { emu_cp_async16(s, g, valid ? 16 : 0); }
inline void cp_async16(void* s, const void* g, bool valid) { cp_async16_s(smem_u32(s), g, valid); }
inline void cp_async_commit() { emu_cp_commit(); }
template <int N> inline void cp_async_wait() { emu_cp_wait(N); }
inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  emu_mma<EMU_KIND_BF16>(d, a, b0, b1);
}
// ex2.approx / tanh.approx as the exact functions (the driver's tolerance covers the SFU error).
inline float ex2_approx(float x) { return exp2f(x); }
inline float tanh_approx(float x) { return tanhf(x); }
inline void sts_u32(unsigned a, unsigned v) { sts32(a, v); }
inline unsigned dynamic_smem_bytes() { return (unsigned)g_smem_bytes; }
inline void red_add2(float* p, float x, float y) {
  std::atomic_ref<float>(p[0]).fetch_add(x);
  std::atomic_ref<float>(p[1]).fetch_add(y);
}
