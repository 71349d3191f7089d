//! The two 8-bit floating formats of Hopper's tensor cores (the OCP FP8 formats, as CUDA's
//! `__nv_fp8_e4m3` / `__nv_fp8_e5m2` and PyTorch's `float8_e4m3fn` / `float8_e5m2` store them):
//!
//! | format | sign·exponent·mantissa | bias | largest finite | smallest subnormal | Inf | NaN |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | e4m3 | 1·4·3 | 7 | 448 | 2⁻⁹ | none | `S.1111.111` |
//! | e5m2 | 1·5·2 | 15 | 57344 | 2⁻¹⁶ | `S.11111.00` | `S.11111.{01,10,11}` |
//!
//! e4m3 (more precision) carries weights and activations, e5m2 (more range) gradients.
//! Conversion from f32 rounds to nearest, ties to even, and **saturates**: magnitudes past the
//! largest finite value (Inf included) become ±largest, NaN becomes the canonical NaN `0x7F` —
//! PTX's `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`, so host and device quantise bit for bit alike.
//! (PyTorch's `.to(float8_e4m3fn)` does not saturate: it gives NaN past 448; scaling recipes keep
//! values in range, so both agree wherever a recipe is followed.)

use super::dtype::{DType, Element};

/// One of the two FP8 encodings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Format {
    /// Exponent bits.
    pub exp_bits: u32,
    /// Mantissa bits.
    pub man_bits: u32,
    /// Exponent bias.
    pub bias: i32,
    /// Whether the all-ones exponent encodes Inf/NaN (e5m2, IEEE-like) or is an ordinary binade
    /// whose all-ones mantissa alone is NaN (e4m3: no Inf).
    pub ieee_specials: bool,
}

/// e4m3 (`float8_e4m3fn`): 4 exponent bits, 3 mantissa bits, largest finite 448, no Inf.
pub const E4M3: Fp8Format = Fp8Format {
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    ieee_specials: false,
};
/// e5m2: 5 exponent bits, 2 mantissa bits, largest finite 57344, IEEE Inf and NaN.
pub const E5M2: Fp8Format = Fp8Format {
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    ieee_specials: true,
};

/// The NaN a conversion writes (both formats): positive sign, every exponent and mantissa bit set.
pub const CANONICAL_NAN: u8 = 0x7F;

impl Fp8Format {
    /// The format of an FP8 dtype, None for any other.
    pub fn of(dtype: DType) -> Option<Fp8Format> {
        match dtype {
            DType::F8E4M3 => Some(E4M3),
            DType::F8E5M2 => Some(E5M2),
            _ => None,
        }
    }

    fn man_mask(self) -> u8 {
        (1u8 << self.man_bits) - 1
    }

    fn exp_max_field(self) -> i32 {
        (1 << self.exp_bits) - 1
    }

    /// The code (sign clear) of the largest finite value: `0.1111.110` for e4m3, `0.11110.11`
    /// for e5m2.
    pub fn max_code(self) -> u8 {
        if self.ieee_specials {
            (((self.exp_max_field() - 1) as u8) << self.man_bits) | self.man_mask()
        } else {
            ((self.exp_max_field() as u8) << self.man_bits) | (self.man_mask() - 1)
        }
    }

    /// The largest finite magnitude (448 for e4m3, 57344 for e5m2).
    pub fn max_finite(self) -> f32 {
        self.decode(self.max_code())
    }

    /// The value of `code` as f32 (exact: every FP8 value is an f32).
    pub fn decode(self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let e = ((code & 0x7F) >> self.man_bits) as i32;
        let m = (code & self.man_mask()) as i32;
        let top = e == self.exp_max_field();
        let v = if self.ieee_specials && top {
            if m == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else if !self.ieee_specials && top && m == self.man_mask() as i32 {
            f32::NAN
        } else if e == 0 {
            // Subnormal: m · 2^(1 − bias − man_bits).
            m as f32 * pow2(1 - self.bias - self.man_bits as i32)
        } else {
            (((1 << self.man_bits) + m) as f32) * pow2(e - self.bias - self.man_bits as i32)
        };
        if negative {
            -v
        } else {
            v
        }
    }

    /// `x` rounded to nearest (ties to even) and saturated to the largest finite value; NaN to
    /// [`CANONICAL_NAN`]. The sign of zero is kept.
    pub fn encode(self, x: f32) -> u8 {
        self.encode_f64(x as f64)
    }

    /// As [`encode`](Fp8Format::encode), from f64 (rounded once, straight to FP8).
    pub fn encode_f64(self, x: f64) -> u8 {
        if x.is_nan() {
            return CANONICAL_NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let max = self.max_finite() as f64;
        if a >= max {
            return sign | self.max_code();
        }
        // The quantum of a's binade (or of the subnormal range below the smallest normal),
        // then a in quanta rounded to an integer: exact in f64 (a scaling by a power of two).
        let min_exp = 1 - self.bias;
        let e = if a == 0.0 {
            min_exp
        } else {
            f64_exponent(a).max(min_exp)
        };
        let q = pow2_f64(e - self.man_bits as i32);
        let r = (a / q).round_ties_even();
        if r == 0.0 {
            return sign;
        }
        // r ≤ 2^(man_bits+1): exactly 2^(man_bits+1) carries into the next binade.
        let (mut e_field, mut man) = if e == min_exp && r < (1u32 << self.man_bits) as f64 {
            (0, r as u32)
        } else {
            (e + self.bias, r as u32 - (1 << self.man_bits))
        };
        if man == 1 << self.man_bits {
            e_field += 1;
            man = 0;
        }
        let code = ((e_field as u8) << self.man_bits) | man as u8;
        // a < max, so rounding reaches at most the largest finite code.
        debug_assert!(code <= self.max_code());
        sign | code
    }
}

/// 2^e as f32 for the exponents FP8 values have (−25 … 15).
fn pow2(e: i32) -> f32 {
    pow2_f64(e) as f32
}

/// 2^e as f64 (|e| < 1000).
fn pow2_f64(e: i32) -> f64 {
    f64::from_bits(((1023 + e as i64) as u64) << 52)
}

/// ⌊log2 a⌋ of a positive, normal f64 (FP8 inputs below f64's normal range round to zero
/// anyway: the exponent is clamped to the format's smallest).
fn f64_exponent(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

macro_rules! fp8_element {
    ($name:ident, $fmt:expr, $dtype:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable,
        )]
        #[repr(transparent)]
        pub struct $name(pub u8);

        // SAFETY: a transparent u8: any bit pattern is valid, no padding, Copy.
        unsafe impl cudarc::driver::DeviceRepr for $name {}

        impl $name {
            /// `x` rounded to nearest even and saturated (see the module docs).
            pub fn from_f32(x: f32) -> Self {
                $name($fmt.encode(x))
            }
            /// The value as f32 (exact).
            pub fn to_f32(self) -> f32 {
                $fmt.decode(self.0)
            }
        }

        impl Element for $name {
            const DTYPE: DType = $dtype;
            fn to_f64(self) -> f64 {
                self.to_f32() as f64
            }
            fn from_f64(v: f64) -> Self {
                $name($fmt.encode_f64(v))
            }
        }
    };
}
fp8_element!(
    F8E4M3,
    E4M3,
    DType::F8E4M3,
    "An e4m3 FP8 value (its code): weights and activations."
);
fp8_element!(
    F8E5M2,
    E5M2,
    DType::F8E5M2,
    "An e5m2 FP8 value (its code): gradients (wider range, less precision)."
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::rng::Rng;

    /// Every finite value of `fmt` with its code, ascending by value (positive codes only).
    fn finite_values(fmt: Fp8Format) -> Vec<(f64, u8)> {
        let mut v: Vec<(f64, u8)> = (0u8..0x80)
            .map(|c| (fmt.decode(c) as f64, c))
            .filter(|(x, _)| x.is_finite())
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    /// The independent reference: the nearest finite value by exhaustive search, a tie going to
    /// the code with an even mantissa, saturating; NaN to the canonical NaN.
    fn nearest(fmt: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return CANONICAL_NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = (x.abs() as f64).min(fmt.max_finite() as f64);
        let vals = finite_values(fmt);
        let mut best = vals[0];
        for &(v, c) in &vals {
            let (d, db) = ((v - a).abs(), (best.0 - a).abs());
            if d < db || (d == db && c & 1 == 0 && best.1 & 1 == 1) {
                best = (v, c);
            }
        }
        sign | best.1
    }

    #[test]
    fn decode_matches_the_published_tables() {
        // (code, e4m3 value, e5m2 value): the formats' defining points.
        let table: [(u8, f32, f32); 12] = [
            (0x00, 0.0, 0.0),
            (0x01, 2f32.powi(-9), 2f32.powi(-16)),
            (0x07, 7.0 * 2f32.powi(-9), 1.75 * 2f32.powi(-14)),
            (0x08, 2f32.powi(-6), 1.0 * 2f32.powi(-13)),
            (0x38, 1.0, 0.5),
            (0x3C, 1.5, 1.0),
            (0x40, 2.0, 2.0),
            (0x7B, 2f32.powi(8) * 1.375, 57344.0),
            (0x7C, 2f32.powi(8) * 1.5, f32::INFINITY),
            (0x7E, 448.0, f32::NAN),
            (0x80, -0.0, -0.0),
            (0xB8, -1.0, -0.5),
        ];
        for (code, e4, e5) in table {
            for (fmt, want) in [(E4M3, e4), (E5M2, e5)] {
                let got = fmt.decode(code);
                assert!(
                    got == want && got.is_sign_negative() == want.is_sign_negative()
                        || got.is_nan() && want.is_nan(),
                    "{fmt:?} {code:#04x}: {got} want {want}"
                );
            }
        }
        assert!(E4M3.decode(0x7F).is_nan() && E4M3.decode(0xFF).is_nan());
        assert_eq!(E4M3.max_finite(), 448.0);
        assert_eq!(E5M2.max_finite(), 57344.0);
        assert_eq!(E5M2.decode(0xFC), f32::NEG_INFINITY);
        // Finite codes with the sign clear: e4m3 0x00–0x7E (0x7F is NaN), e5m2 0x00–0x7B.
        assert_eq!(finite_values(E4M3).len(), 127);
        assert_eq!(finite_values(E5M2).len(), 124);
    }

    #[test]
    fn every_code_round_trips() {
        for fmt in [E4M3, E5M2] {
            for c in 0..=255u8 {
                let v = fmt.decode(c);
                if v.is_nan() {
                    assert_eq!(fmt.encode(v), CANONICAL_NAN);
                } else if v.is_infinite() {
                    assert_eq!(fmt.encode(v), (c & 0x80) | fmt.max_code(), "Inf saturates");
                } else {
                    assert_eq!(fmt.encode(v), c, "{fmt:?} {c:#04x} ({v})");
                }
            }
        }
    }

    #[test]
    fn encode_matches_exhaustive_nearest_even_with_saturation() {
        let mut rng = Rng::new(8);
        for fmt in [E4M3, E5M2] {
            // Every midpoint between neighbours (the ties), each side of it by one f32 ulp, and
            // each value's neighbours: where rounding decides.
            let vals = finite_values(fmt);
            let mut xs: Vec<f32> = Vec::new();
            for w in vals.windows(2) {
                let mid = ((w[0].0 + w[1].0) / 2.0) as f32;
                xs.extend([mid, mid.next_up(), mid.next_down(), w[0].0 as f32]);
            }
            let max = fmt.max_finite();
            xs.extend([
                max.next_up(),
                max * 1.03,
                max * 1.1,
                1e30,
                f32::INFINITY,
                f32::MIN_POSITIVE,
                1e-30,
                0.0,
            ]);
            // Random magnitudes over the whole range, log-uniform.
            for _ in 0..20_000 {
                let e = rng.uniform(-30.0, 20.0);
                xs.push(2f64.powf(e) as f32);
            }
            for x in xs {
                for s in [x, -x] {
                    assert_eq!(
                        fmt.encode(s),
                        nearest(fmt, s),
                        "{fmt:?} {s:e} ({:#010x})",
                        s.to_bits()
                    );
                }
            }
            assert_eq!(fmt.encode(f32::NAN), CANONICAL_NAN);
            assert_eq!(fmt.encode(-f32::NAN), CANONICAL_NAN);
            assert_eq!(fmt.encode(-0.0), 0x80, "the sign of zero is kept");
        }
    }

    #[test]
    fn element_types_carry_their_dtype() {
        assert_eq!(F8E4M3::from_f32(1.0), F8E4M3(0x38));
        assert_eq!(F8E5M2::from_f32(-2.0).to_f32(), -2.0);
        assert_eq!(<F8E4M3 as Element>::DTYPE.size_in_bytes(), 1);
        assert_eq!(F8E4M3::from_f64(1000.0).to_f32(), 448.0);
    }
}
