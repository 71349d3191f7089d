// async.cuh — cp.async (sm_80+): global → shared copies that bypass the registers, for every
// kernel that streams tiles or rows through a shared-memory ring (matmul's mma and warptile
// rungs, attention's flash, decode, norm's backward, cross-entropy's pass 1). The host emulators
// (scripts/*-emu) remove these by name and model them.
#ifndef FERRITE_ASYNC_CUH
#define FERRITE_ASYNC_CUH

#include "ferrite.cuh"

namespace ferrite {

// 16 bytes from global into shared memory, bypassing L1 (.cg). A thread can have many in flight
// at no register cost. Completion is per thread (cp_async_wait below returns once all but the N
// newest committed groups have landed), so a thread that reads back only what it copied itself
// needs no barrier.
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(s)), "l"(g) : "memory");
}
// The same with a mask: valid == false reads nothing and writes 16 zero bytes (a tile row past
// the end of a matrix or sequence must be zeros, not stale data: 0 · NaN would poison a sum).
__device__ __forceinline__ void cp_async16(void* s, const void* g, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(s)), "l"(g),
               "r"(valid ? 16 : 0)
               : "memory");
}
// The masked copy to a shared address already in the shared state space (smem_u32), for loops
// that step the address by adds.
__device__ __forceinline__ void cp_async16_s(unsigned s, const void* g, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 4 bytes through L1 (.ca: 4-byte copies cannot bypass it); src_bytes 0 writes a zero and reads
// nothing.
__device__ __forceinline__ void cp_async4(void* s, const void* g, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(s)), "l"(g),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace ferrite

#endif  // FERRITE_ASYNC_CUH
