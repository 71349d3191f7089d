// async.cuh — cp.async helpers for the row kernels (norm's backward ring, cross-entropy's pass 1).
// Kept out of ferrite.cuh so the attention and matmul host emulators, which expand ferrite.cuh
// and model their kernels' own PTX wrappers, need no model of these.
#ifndef FERRITE_ASYNC_CUH
#define FERRITE_ASYNC_CUH

namespace ferrite {

// cp.async of 16 bytes from global into shared memory (sm_80+), bypassing L1 and the registers:
// a thread can have many in flight at no register cost. Completion is per thread (the wait below
// returns once all but the N newest committed groups have landed), so a thread that reads back
// only what it copied itself needs no barrier.
__device__ __forceinline__ void async_copy16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   (unsigned)__cvta_generic_to_shared(smem_dst)),
               "l"(gmem_src)
               : "memory");
}
__device__ __forceinline__ void async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace ferrite

#endif  // FERRITE_ASYNC_CUH
