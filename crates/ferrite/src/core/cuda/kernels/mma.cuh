// mma.cuh — warp-level tensor-core MMA (mma.sync, sm_80+) for kernels that build their operand
// fragments in registers themselves.
#ifndef FERRITE_MMA_CUH
#define FERRITE_MMA_CUH

namespace ferrite {

// Whether a 16-bit element type is bf16 (the MMA's input kind).
template <typename U> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

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

}  // namespace ferrite

#endif  // FERRITE_MMA_CUH
