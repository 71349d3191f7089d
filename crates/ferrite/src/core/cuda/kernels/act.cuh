// act.cuh — the activations' forward and derivative in fp32, shared by the activation family's
// kernels (compile-time FE_ACT) and moe's GLU backward (a runtime code dispatched to the
// template). Codes: 0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf, 4 silu.

#include "sfu.cuh"

#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_C 0.044715f
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

#define LOG2E 1.4426950408889634f

// σ(z) = 1/(1 + 2^(−z·log₂e)) from t = −z·log₂e: t → +∞ gives 1/∞ = 0, t → −∞ gives 1; NaN stays NaN.
__device__ __forceinline__ float sigmoid_of_neg_log2(float t) {
  return ferrite::rcp_approx(1.f + ferrite::ex2_approx(t));
}

// a = act(h) and d = act'(h) for activation code ACT; callers using one of them let the compiler
// drop the other.
template <int ACT>
__device__ __forceinline__ void act_fg_of(float h, float& a, float& d) {
  if constexpr (ACT == 0) {
    a = h;
    d = 1.f;
  } else if constexpr (ACT == 1) {
    a = (h > 0.f || isnan(h)) ? h : 0.f;  // NaN stays NaN, as torch's relu
    d = h > 0.f ? 1.f : 0.f;
  } else if constexpr (ACT == 2) {
    // 0.5·(1 + tanh(u)) = σ(2u): one exponential instead of tanhf, and no cancellation where
    // tanh → −1. With u = k·(h + c·h³): −2u·log₂e = h·(C1 + C2·h²), C1 = −2k·log₂e, C2 = C1·c.
    // Then a = h·σ, d = σ + σ(1 − σ)·h·(2k + 6kc·h²).
    const float h2 = h * h;
    const float s = sigmoid_of_neg_log2(h * fmaf(-2.f * SQRT_2_OVER_PI * LOG2E * GELU_C, h2,
                                                  -2.f * SQRT_2_OVER_PI * LOG2E));
    a = h * s;
    d = fmaf(s * (1.f - s), h * fmaf(6.f * SQRT_2_OVER_PI * GELU_C, h2, 2.f * SQRT_2_OVER_PI), s);
  } else if constexpr (ACT == 3) {
    const float e = erff(h * INV_SQRT2);
    a = 0.5f * h * (1.f + e);
    d = 0.5f * (1.f + e) + h * INV_SQRT_2PI * ferrite::ex2_approx(-0.5f * LOG2E * h * h);
  } else {
    static_assert(ACT == 4, "activation codes 0..4");
    const float s = sigmoid_of_neg_log2(-LOG2E * h);
    a = h * s;
    d = s * (1.f + h * (1.f - s));
  }
}
