//! CPU activation ops in fp32 (16-bit inputs widened). `naive`: one thread; `parallel`: rows
//! across cores (rayon), the same arithmetic per element and db summed per column in row order
//! either way, so both give identical bits. The dropout mask comes from `core::philox`, the same
//! bits the CUDA kernels draw.

use super::{Activation, Dropout, Problem};
use crate::core::cpu::{for_rows, with_f32, with_f32_out};
use crate::core::error::Result;
use crate::core::philox;
use crate::core::tensor::Tensor;
use rayon::prelude::*;

pub const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
pub const GELU_C: f64 = 0.044715;
pub const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// erf in f64, accurate to ~1e-13 (std has none): the Maclaurin series below 3 (its terms peak
/// near e^(x²) ≈ 8e3, costing 4 of f64's 16 digits), the Laplace continued fraction of erfc
/// from 3 to 6, and ±1 beyond (erfc(6) ≈ 2e-17).
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let r = if a < 3.0 {
        let a2 = a * a;
        let (mut term, mut sum) = (a, a);
        for k in 1..200 {
            term *= -a2 / k as f64;
            let t = term / (2 * k + 1) as f64;
            sum += t;
            if t.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else if a < 6.0 {
        // erfc(a) = e^(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))), evaluated backwards.
        let mut f = 0.0;
        for k in (1..=120).rev() {
            f = (k as f64 * 0.5) / (a + f);
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * (a + f))
    } else {
        1.0
    };
    r.copysign(x)
}

/// (act(h), act'(h)) in f32, the formulas the kernels use (relu'(0) = 0).
#[inline]
pub fn act_fg(act: Activation, h: f32) -> (f32, f32) {
    match act {
        Activation::None => (h, 1.0),
        Activation::Relu => {
            if h > 0.0 {
                (h, 1.0)
            } else if h.is_nan() {
                (h, 0.0) // NaN stays NaN, as torch's relu (whose gradient there is 0)
            } else {
                (0.0, 0.0)
            }
        }
        Activation::GeluTanh => {
            // 0.5·(1 + tanh(u)) = σ(2u), as the kernels compute it (the f64 reference keeps tanh).
            let (k, c) = (SQRT_2_OVER_PI as f32, GELU_C as f32);
            let u = k * (h + c * h * h * h);
            let s = 1.0 / (1.0 + (-2.0 * u).exp());
            (
                h * s,
                s + 2.0 * h * s * (1.0 - s) * k * (1.0 + 3.0 * c * h * h),
            )
        }
        Activation::GeluErf => {
            let e = erf(h as f64 * std::f64::consts::FRAC_1_SQRT_2) as f32;
            (
                0.5 * h * (1.0 + e),
                0.5 * (1.0 + e) + h * INV_SQRT_2PI as f32 * (-0.5 * h * h).exp(),
            )
        }
        Activation::Silu => {
            let s = 1.0 / (1.0 + (-h).exp());
            (h * s, s * (1.0 + h * (1.0 - s)))
        }
    }
}

/// Applies dropout to `vals`, the elements `start..start + len` of the tensor: kept ones scaled,
/// dropped ones zeroed (one Philox block per 8 elements, 16-bit draws: `philox::draw`).
pub fn apply_mask(vals: &mut [f32], start: u64, d: &Dropout, thr: u32, scale: f32) {
    let (mut blk, mut have) = ([0u32; 4], u64::MAX);
    for (k, v) in vals.iter_mut().enumerate() {
        let i = start + k as u64;
        if i / 8 != have {
            have = i / 8;
            blk = philox::block(d.seed, d.offset, have);
        }
        *v = if philox::draw_of(&blk, i) < thr {
            *v * scale
        } else {
            0.0
        };
    }
}

fn bias_vec(bias: Option<&Tensor>) -> Result<Option<Vec<f32>>> {
    bias.map(|b| b.to_f32_vec()).transpose()
}

pub fn act_forward(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    bias: Option<&Tensor>,
    y: &Tensor,
    d: &Dropout,
) -> Result<()> {
    let c = p.cols;
    let b = bias_vec(bias)?;
    let dp = d.params();
    let mut unit = vec![(); p.rows];
    with_f32(x, |xv| {
        with_f32_out(y, |out| {
            for_rows(variant == "parallel", c, out, &mut unit, |r, o, _| {
                let xr = &xv[r * c..][..c];
                for (j, (oj, &xj)) in o.iter_mut().zip(xr).enumerate() {
                    let h = xj + b.as_ref().map_or(0.0, |b| b[j]);
                    *oj = act_fg(p.act, h).0;
                }
                if let Some((thr, scale)) = dp {
                    apply_mask(o, (r * c) as u64, d, thr, scale);
                }
            })
        })
    })?
}

/// Σ over rows of `m` (rows × cols, row-major) per column, in row order with an f64 accumulator;
/// columns in blocks, the blocks across cores when `parallel` (same order, same bits).
pub fn col_sums(parallel: bool, m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const BLOCK: usize = 256;
    let block = |j0: usize| {
        let w = BLOCK.min(cols - j0);
        let mut acc = vec![0f64; w];
        for r in 0..rows {
            for (a, &v) in acc.iter_mut().zip(&m[r * cols + j0..][..w]) {
                *a += v as f64;
            }
        }
        acc.into_iter().map(|a| a as f32).collect::<Vec<f32>>()
    };
    let starts: Vec<usize> = (0..cols).step_by(BLOCK).collect();
    if parallel {
        starts.into_par_iter().flat_map_iter(block).collect()
    } else {
        starts.into_iter().flat_map(block).collect()
    }
}

#[allow(clippy::too_many_arguments)]
pub fn act_backward(
    variant: &str,
    p: &Problem,
    dy: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    dx: &Tensor,
    dbias: Option<&Tensor>,
    d: &Dropout,
) -> Result<()> {
    let c = p.cols;
    let b = bias_vec(bias)?;
    let dp = d.params();
    let parallel = variant == "parallel";
    let mut unit = vec![(); p.rows];
    let mut db = None;
    with_f32(dy, |g| {
        with_f32(x, |xv| {
            with_f32_out(dx, |out| {
                for_rows(parallel, c, out, &mut unit, |r, o, _| {
                    o.copy_from_slice(&g[r * c..][..c]);
                    if let Some((thr, scale)) = dp {
                        apply_mask(o, (r * c) as u64, d, thr, scale);
                    }
                    let xr = &xv[r * c..][..c];
                    for (j, (oj, &xj)) in o.iter_mut().zip(xr).enumerate() {
                        let h = xj + b.as_ref().map_or(0.0, |b| b[j]);
                        *oj *= act_fg(p.act, h).1;
                    }
                });
                if dbias.is_some() {
                    db = Some(col_sums(parallel, out, p.rows, c));
                }
            })
        })
    })???;
    if let (Some(t), Some(v)) = (dbias, db) {
        t.write_f32(&v)?;
    }
    Ok(())
}

pub fn glu_forward(variant: &str, p: &Problem, input: &Tensor, out: &Tensor) -> Result<()> {
    let n = p.cols;
    let mut unit = vec![(); p.rows];
    with_f32(input, |iv| {
        with_f32_out(out, |o| {
            for_rows(variant == "parallel", n, o, &mut unit, |r, o, _| {
                let (gate, up) = iv[r * 2 * n..][..2 * n].split_at(n);
                for ((oj, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    *oj = act_fg(p.act, g).0 * u;
                }
            })
        })
    })?
}

pub fn glu_backward(
    variant: &str,
    p: &Problem,
    dout: &Tensor,
    input: &Tensor,
    dinput: &Tensor,
) -> Result<()> {
    let n = p.cols;
    let mut unit = vec![(); p.rows];
    with_f32(dout, |dv| {
        with_f32(input, |iv| {
            with_f32_out(dinput, |o| {
                for_rows(variant == "parallel", 2 * n, o, &mut unit, |r, o, _| {
                    let (gate, up) = iv[r * 2 * n..][..2 * n].split_at(n);
                    let (dg, du) = o.split_at_mut(n);
                    let g = &dv[r * n..][..n];
                    for j in 0..n {
                        let (a, da) = act_fg(p.act, gate[j]);
                        dg[j] = g[j] * up[j] * da;
                        du[j] = g[j] * a;
                    }
                })
            })
        })
    })??
}
