// mma.cuh — warp-level tensor-core building blocks (sm_80+): ldmatrix fragment loads from shared
// memory, mma.sync, and the 16-bit packing between fp32 accumulators and operand registers. Used
// by matmul's mma and skinny rungs, attention's flash and decode's mma kernels; the host
// emulators (scripts/*-emu) remove the asm ones by name and model them.
#ifndef FERRITE_MMA_CUH
#define FERRITE_MMA_CUH

#include "ferrite.cuh"

namespace ferrite {

// ---- ldmatrix: four (or two) 8×8 matrices of 16-bit values from shared memory, one row address
// per lane (lanes 8i..8i+7 address matrix i); register i of every lane receives its piece of
// matrix i in the mma fragment layout; .trans transposes each matrix on the way.
__device__ __forceinline__ void ldsm_x4_s(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_ts(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(p)));
}

// d += a·b for one m16n8k16 tile, fp32 accumulate; BF16 picks bf16 inputs, else f16. Fragments in
// the PTX order, g = lane / 4, q = lane % 4: a[0] = A(g, 2q..2q+1), a[1] = A(g+8, 2q..),
// a[2] = A(g, 2q+8..2q+9), a[3] = A(g+8, 2q+8..); b0 = B(2q..2q+1, g), b1 = B(2q+8..2q+9, g);
// d[0..1] = D(g, 2q..2q+1), d[2..3] = D(g+8, 2q..2q+1). Two 16-bit values per register, the
// lower k in the low half.
template <bool BF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// d += a·b for one m16n8k8 tile of tf32 inputs (fp32 bit patterns, rounded by cvt.rna.tf32),
// fp32 accumulate; fragments as above with k 8: a[0] = A(g, q), a[1] = A(g+8, q), a[2] = A(g, q+4),
// a[3] = A(g+8, q+4); b0 = B(q, g), b1 = B(q+4, g).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                 unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 32-bit store to shared memory at a shared-state-space address (as ldmatrix takes them).
__device__ __forceinline__ void sts_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// x rounded to tf32 (10 mantissa bits, to nearest, ties away from zero), as an fp32 value whose
// low 13 bits are zero: the operand form the tf32 mma and wgmma expect.
__device__ __forceinline__ float tf32_rna(float x) {
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(u) : "f"(x));
  return __uint_as_float(u);
}

// Two floats → one register of two 16-bit U values (low half = x), rounded to nearest: an fp32
// accumulator pair becomes half of an A fragment (or two elements of a 32-bit store).
template <typename U>
__device__ __forceinline__ unsigned pack2(float x, float y) {
  static_assert(sizeof(U) == 2, "pack2 packs 16-bit types");
  if constexpr (IsBf16<U>::value) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
  } else {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
  }
}
// The inverse: one register of two 16-bit U values → two floats (x = the low half).
template <typename U>
__device__ __forceinline__ float2 unpack2(unsigned u) {
  static_assert(sizeof(U) == 2, "unpack2 unpacks 16-bit types");
  if constexpr (IsBf16<U>::value) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
}

}  // namespace ferrite

#endif  // FERRITE_MMA_CUH
