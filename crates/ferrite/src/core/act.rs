//! The activation functions shared by the op families.

use crate::core::error::{Error, Result};

/// The pointwise function after a bias: of the activation family's bias + activation (+ dropout)
/// and GLU passes, of a GEMM's epilogue (matmul, linear), of MoE's expert MLPs and of the
/// trainer's MLP. One type, one set of formulas (the kernels' `FE_ACT` / `FE_EPI` codes mirror
/// [`code`](Activation::code)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// The identity: bias (and residual) only.
    #[default]
    None,
    /// max(v, 0); NaN stays NaN, as torch's.
    Relu,
    /// GELU, tanh approximation: ½v(1 + tanh(√(2/π)(v + 0.044715v³))).
    GeluTanh,
    /// GELU, exact: ½v(1 + erf(v/√2)).
    GeluErf,
    /// SiLU / swish: v·σ(v).
    Silu,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_A: f64 = 0.044715;

impl Activation {
    /// Every activation, in code order.
    pub const ALL: [Activation; 5] = [
        Activation::None,
        Activation::Relu,
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Silu,
    ];

    /// The name as the CLI, the bench tables and [`parse`](Activation::parse) spell it.
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::GeluErf => "gelu_erf",
            Activation::Silu => "silu",
        }
    }

    /// The activation [`name`](Activation::name) names, if any.
    pub fn parse(s: &str) -> Option<Activation> {
        Activation::ALL.into_iter().find(|a| a.name() == s)
    }

    /// [`parse`](Activation::parse) for an argument `arg` of `op`: an error listing the names.
    pub fn parse_arg(op: &str, arg: &str, s: &str) -> Result<Activation> {
        Activation::parse(s).ok_or_else(|| {
            Error::bad_arg(op, arg, "one of none, relu, gelu_tanh, gelu_erf, silu", s)
        })
    }

    /// The kernels' `FE_EPI` / `FE_ACT` code (0 = none ... 4 = silu).
    pub fn code(self) -> u32 {
        match self {
            Activation::None => 0,
            Activation::Relu => 1,
            Activation::GeluTanh => 2,
            Activation::GeluErf => 3,
            Activation::Silu => 4,
        }
    }

    /// act(v) in fp32, the same formulas as the kernels.
    #[inline]
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Activation::None => v,
            // NaN stays NaN, as torch's relu
            Activation::Relu => {
                if v > 0.0 || v.is_nan() {
                    v
                } else {
                    0.0
                }
            }
            Activation::GeluTanh => {
                let u = SQRT_2_OVER_PI as f32 * (v + GELU_A as f32 * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            }
            Activation::GeluErf => {
                0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2))
            }
            Activation::Silu => v / (1.0 + (-v).exp()),
        }
    }

    /// act'(v) in fp32 (the backward's dZ = dY·act'(Z)).
    #[inline]
    pub fn grad(self, v: f32) -> f32 {
        self.grad_f64(v as f64) as f32
    }

    /// act(v) in f64 (the references).
    pub fn apply_f64(self, v: f64) -> f64 {
        match self {
            Activation::None => v,
            // NaN stays NaN, as torch's relu
            Activation::Relu => {
                if v > 0.0 || v.is_nan() {
                    v
                } else {
                    0.0
                }
            }
            Activation::GeluTanh => {
                let u = SQRT_2_OVER_PI * (v + GELU_A * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            }
            Activation::GeluErf => 0.5 * v * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2)),
            Activation::Silu => v / (1.0 + (-v).exp()),
        }
    }

    /// act'(v) in f64.
    pub fn grad_f64(self, v: f64) -> f64 {
        match self {
            Activation::None => 1.0,
            Activation::Relu => {
                if v > 0.0 {
                    1.0
                } else {
                    0.0
                }
            }
            Activation::GeluTanh => {
                let u = SQRT_2_OVER_PI * (v + GELU_A * v * v * v);
                let t = u.tanh();
                0.5 * (1.0 + t)
                    + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_A * v * v)
            }
            Activation::GeluErf => {
                let cdf = 0.5 * (1.0 + libm::erf(v * std::f64::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                cdf + v * pdf
            }
            Activation::Silu => {
                let s = 1.0 / (1.0 + (-v).exp());
                s * (1.0 + v * (1.0 - s))
            }
        }
    }
}

impl std::fmt::Display for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
