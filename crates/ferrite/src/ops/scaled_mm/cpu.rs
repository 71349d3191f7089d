//! CPU rungs of the scaled GEMM, fp32 accumulation. `naive`: one thread, every FP8 element
//! decoded (`Fp8Format::decode`) as the dot product reads it. `parallel`: A and B decoded once
//! into f32 through a 256-entry table (one lookup per element instead of the bit arithmetic per
//! multiply-add), then rows of D across cores with 8 independent partial sums per dot product,
//! which the compiler keeps in vector registers. Both check the scales' values first (finite,
//! non-zero): here that costs nothing.

use super::{Problem, OP};
use crate::core::cpu::{dot8, for_rows, with_f32, with_f32_out};
use crate::core::error::{Error, Result};
use crate::core::fp8::Fp8Format;
use crate::core::tensor::Tensor;

/// The scale values, refusing NaN, Inf and zero (a zero scale would silently zero D).
fn scales(name: &str, t: &Tensor) -> Result<Vec<f32>> {
    let v = t.to_f32_vec()?;
    if let Some(bad) = v.iter().find(|x| !x.is_finite() || **x == 0.0) {
        return Err(Error::bad_arg(
            OP,
            name,
            "finite, non-zero dequantisation scales",
            format!("a scale of {bad}"),
        ));
    }
    Ok(v)
}

/// The value of every code of a format: index = code.
fn table(fmt: Fp8Format) -> [f32; 256] {
    std::array::from_fn(|c| fmt.decode(c as u8))
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    variant: &str,
    p: &Problem,
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    let sa = scales("scale_a", scale_a)?;
    let sb = scales("scale_b", scale_b)?;
    let (fa, fb) = (
        Fp8Format::of(p.a_dtype).expect("validated FP8"),
        Fp8Format::of(p.b_dtype).expect("validated FP8"),
    );
    // The views' codes, row-major and dense.
    let (ac, bc) = (a.to_bytes()?, b.to_bytes()?);
    let bias_v = match bias {
        Some(t) => with_f32(t, |v| v.to_vec())?,
        None => vec![0f32; p.n],
    };
    let (k, n) = (p.k, p.n);
    let sa_of = |i: usize| if p.sa_row { sa[i] } else { sa[0] };
    let sb_of = |j: usize| if p.sb_col { sb[j] } else { sb[0] };
    let mut unit = vec![(); p.m];
    if variant == "naive" {
        return with_f32_out(out, |o| {
            for_rows(false, n, o, &mut unit, |i, row, _| {
                let ar = &ac[i * k..][..k];
                for (j, dj) in row.iter_mut().enumerate() {
                    let br = &bc[j * k..][..k];
                    let mut acc = 0f32;
                    for (&x, &y) in ar.iter().zip(br) {
                        acc += fa.decode(x) * fb.decode(y);
                    }
                    *dj = acc * sa_of(i) * sb_of(j) + bias_v[j];
                }
            })
        });
    }
    let (ta, tb) = (table(fa), table(fb));
    let av: Vec<f32> = ac.iter().map(|&c| ta[c as usize]).collect();
    let bv: Vec<f32> = bc.iter().map(|&c| tb[c as usize]).collect();
    with_f32_out(out, |o| {
        for_rows(true, n, o, &mut unit, |i, row, _| {
            let ar = &av[i * k..][..k];
            for (j, dj) in row.iter_mut().enumerate() {
                *dj = dot8(ar, &bv[j * k..][..k]) * sa_of(i) * sb_of(j) + bias_v[j];
            }
        })
    })
}
