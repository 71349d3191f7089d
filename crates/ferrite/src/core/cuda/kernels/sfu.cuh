// sfu.cuh — fp32 special functions in one MUFU instruction each (the special-function unit), for
// kernels whose results are rounded to 16 bits next or whose checks allow the SFU's error. Used by
// the activations (act.cuh), matmul's fast epilogues and attention's softmax (flash, hopper); the
// host emulators (scripts/*-emu) remove them by name and model them with the exact functions.
#ifndef FERRITE_SFU_CUH
#define FERRITE_SFU_CUH

namespace ferrite {

// 2^x: ≤ 2⁻²² relative error, subnormal results flushed to 0. exp2f adds a denormal-range fix-up
// of three instructions around the MUFU.EX2; expf is ~10 instructions.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x: ≤ 1 ulp, subnormals flushed to 0 (1.f/x is ~8 instructions plus a slow-path call).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) (sm_75+): max relative error about 2⁻¹¹ — below the rounding of a 16-bit output (2⁻⁹
// bf16, 2⁻¹¹ f16). tanhf is ~20 instructions with two range branches plus an EX2 and an RCP.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace ferrite

#endif  // FERRITE_SFU_CUH
