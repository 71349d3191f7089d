// The host versions of the PTX wrappers of matmul kernels/mma.cu and common.cuh (run.sh), on
// scripts/emu-common/emu.h. FE_MMA_KIND (0 f16, 1 bf16, 2 tf32) picks the emulated mma, as in mma.cu.
#pragma once
#include "../emu-common/emu.h"
#ifndef FE_MMA_KIND
#error "build with -DFE_MMA_KIND (the host always sets it)"
#endif

inline void cp_async16(void* s, const void* g) { emu_cp_async16(smem_u32(s), g, 16); }
inline void cp_async_commit() { emu_cp_commit(); }
template <int N> inline void cp_async_wait() { emu_cp_wait(N); }
inline float tf32_rna(float x) { return __uint_as_float(emu_tf32(__float_as_uint(x))); }
inline void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  emu_mma<FE_MMA_KIND>(d, a, b[0], b[1]);
}
// tanh.approx.f32 as tanhf (run.sh's tolerance covers the SFU's ~2^-11 relative error).
inline float tanh_approx(float x) { return tanhf(x); }
