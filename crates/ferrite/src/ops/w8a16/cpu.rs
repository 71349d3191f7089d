//! CPU rungs of the int8-weight matmul, fp32 accumulation, and the quantiser. `naive`: one
//! thread, every weight byte converted as the dot product reads it. `parallel`: the weight's
//! rows across cores (decoding has few rows of A: parallel over D's rows would leave cores idle
//! at m = 1), each row converted to f32 once and dotted with every row of A through 8
//! independent partial sums (vector registers). Both check the scales' values first (finite,
//! non-zero).

use super::{Problem, OP};
use crate::core::cpu::{dot8, with_f32, with_f32_out};
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use rayon::prelude::*;

/// The scale values, refusing NaN, Inf and zero (a zero scale would silently zero D).
fn scales(t: &Tensor) -> Result<Vec<f32>> {
    let v = t.to_f32_vec()?;
    if let Some(bad) = v.iter().find(|x| !x.is_finite() || **x == 0.0) {
        return Err(Error::bad_arg(
            OP,
            "scale",
            "finite, non-zero dequantisation scales",
            format!("a scale of {bad}"),
        ));
    }
    Ok(v)
}

pub fn run(
    variant: &str,
    p: &Problem,
    a: &Tensor,
    w: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    let s = scales(scale)?;
    // The codes are read where they are when dense (a weight is large: no copy per call).
    if w.is_contiguous() {
        w.with_cpu::<i8, _>(|wc| product(variant, p, a, &wc[..p.n * p.k], &s, bias, out))?
    } else {
        let wc: Vec<i8> = w.to_bytes()?.into_iter().map(|b| b as i8).collect();
        product(variant, p, a, &wc, &s, bias, out)
    }
}

/// D = A·(s ⊙ W)ᵀ + bias with W's codes dense `[n, k]`.
fn product(
    variant: &str,
    p: &Problem,
    a: &Tensor,
    wc: &[i8],
    s: &[f32],
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    let (m, n, k) = (p.m, p.n, p.k);
    // A's values, row-major and dense.
    let av = a.to_f32_vec()?;
    let bias_v = match bias {
        Some(t) => with_f32(t, |v| v.to_vec())?,
        None => vec![0f32; n],
    };
    // D transposed, [n][m]: one weight row's outputs together.
    let mut dt = vec![0f32; n * m];
    if variant == "naive" {
        for (j, col) in dt.chunks_mut(m.max(1)).enumerate().take(n) {
            let wr = &wc[j * k..][..k];
            for (i, dij) in col.iter_mut().enumerate() {
                let ar = &av[i * k..][..k];
                let mut acc = 0f32;
                for (&x, &q) in ar.iter().zip(wr) {
                    acc += x * q as f32;
                }
                *dij = acc * s[j] + bias_v[j];
            }
        }
    } else {
        dt.par_chunks_mut(m.max(1))
            .take(n)
            .enumerate()
            .for_each_init(
                || vec![0f32; k],
                |wf, (j, col)| {
                    for (f, &q) in wf.iter_mut().zip(&wc[j * k..][..k]) {
                        *f = q as f32;
                    }
                    for (i, dij) in col.iter_mut().enumerate() {
                        *dij = dot8(&av[i * k..][..k], wf) * s[j] + bias_v[j];
                    }
                },
            );
    }
    with_f32_out(out, |o| {
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = dt[j * m + i];
            }
        }
    })
}

/// Symmetric per-row int8 codes of `w` `[n, k]` (f32 values, finite): the scale of a row is
/// amax / 127 (1 for an all-zero row), each code `round(w / s)` (half away from zero) clamped to
/// ±127.
pub fn quantize_rows(w: &[f32], n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; n * k];
    let mut s = vec![1f32; n];
    for j in 0..n {
        let row = &w[j * k..][..k];
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax > 0.0 {
            s[j] = amax / 127.0;
        }
        for (c, &v) in q[j * k..][..k].iter_mut().zip(row) {
            *c = (v / s[j]).round().clamp(-127.0, 127.0) as i8;
        }
    }
    (q, s)
}
