//! CPU norms, in fp32 on f32 copies of the inputs (16-bit inputs are widened once), rounded once
//! on the way out. The forward's row sums run in 16 f32 lanes per 1024-element block with the
//! blocks' partials in f64 (`sum_lanes`: vectorised, where a serial f64 sum is one add per 4
//! cycles; a plain f32 sum over a long row would drift by ~√n ulps); the backward's in f64.
//! `naive`: one thread, three passes over each row (mean, variance, normalise).
//! `parallel`: the same arithmetic with rows split across cores (rayon), each thread writing its
//! own rows of the outputs, so results are identical to `naive`.

use super::{Bwd, BwdOut, Fwd, FwdOut, NormKind, Problem};
use crate::core::cpu::{for_rows, sum_lanes, sum_sq_dev_lanes, with_f32, with_f32_out};
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::host;

fn rounder(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        DType::F16 => |v| half::f16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

pub fn forward(variant: &str, p: &Problem, i: &Fwd, o: &FwdOut, eps: f32) -> Result<()> {
    let res = i.residual.map(|t| t.to_f32_vec()).transpose()?;
    let w = i.weight.map(|t| t.to_f32_vec()).transpose()?;
    let b = i.bias.map(|t| t.to_f32_vec()).transpose()?;
    let (rows, cols) = (p.rows, p.cols);
    let round = rounder(p.dtype);
    let layer = p.kind == NormKind::Layer;
    let mut stats = vec![(0f32, 0f32); rows];
    with_f32(i.x, |x| -> Result<()> {
        // h = x + residual, rounded to the storage type (what a separate add kernel would store).
        let h: Option<Vec<f32>> = res
            .as_ref()
            .map(|rv| x.iter().zip(rv).map(|(a, b)| round(a + b)).collect());
        let hv: &[f32] = h.as_deref().unwrap_or(x);
        with_f32_out(o.y, |y| {
            for_rows(variant == "parallel", cols, y, &mut stats, |r, yr, s| {
                let hr = &hv[r * cols..][..cols];
                let mean = if layer {
                    (sum_lanes(hr) / cols as f64) as f32
                } else {
                    0.0
                };
                let var = (sum_sq_dev_lanes(hr, mean) / cols as f64) as f32;
                let rstd = 1.0 / (var + eps).sqrt();
                for (c, (out, &v)) in yr.iter_mut().zip(hr).enumerate() {
                    let mut t = (v - mean) * rstd;
                    if let Some(w) = &w {
                        t *= w[c];
                    }
                    if let Some(b) = &b {
                        t += b[c];
                    }
                    *out = t;
                }
                *s = (mean, rstd);
            })
        })?;
        if let (Some(t), Some(h)) = (o.h, &h) {
            t.write_f32(h)?;
        }
        Ok(())
    })??;
    if let Some(t) = o.mean {
        t.write_f32(&stats.iter().map(|s| s.0).collect::<Vec<_>>())?;
    }
    if let Some(t) = o.rstd {
        t.write_f32(&stats.iter().map(|s| s.1).collect::<Vec<_>>())?;
    }
    Ok(())
}

pub fn backward(variant: &str, p: &Problem, i: &Bwd, o: &BwdOut) -> Result<()> {
    let (dy, x) = (i.dy.to_f32_vec()?, i.x.to_f32_vec()?);
    let w = i.weight.map(|t| t.to_f32_vec()).transpose()?;
    let mean = i.mean.map(|t| t.to_f32_vec()).transpose()?;
    let rstd = i.rstd.to_f32_vec()?;
    let (rows, cols) = (p.rows, p.cols);
    let n = cols as f64;
    let layer = p.kind == NormKind::Layer;
    let mut dx = host::zeroed::<f32>(rows * cols, "norm backward: the CPU path's dx buffer")?;
    let mut unit = vec![(); rows];
    for_rows(
        variant == "parallel",
        cols,
        &mut dx,
        &mut unit,
        |r, dxr, _| {
            let (d, xr) = (&dy[r * cols..][..cols], &x[r * cols..][..cols]);
            let (mu, rs) = (mean.as_ref().map_or(0.0, |m| m[r]), rstd[r]);
            let g = |c: usize| d[c] * w.as_ref().map_or(1.0, |w| w[c]);
            let xh = |c: usize| (xr[c] - mu) * rs;
            let mg = if layer {
                ((0..cols).map(|c| g(c) as f64).sum::<f64>() / n) as f32
            } else {
                0.0
            };
            let mgx = ((0..cols).map(|c| (g(c) * xh(c)) as f64).sum::<f64>() / n) as f32;
            for (c, o) in dxr.iter_mut().enumerate() {
                *o = rs * (g(c) - mg - xh(c) * mgx);
            }
        },
    );
    o.dx.write_f32(&dx)?;
    // dw and db: column sums over rows, in row order (deterministic).
    if o.dweight.is_some() || o.dbias.is_some() {
        let mut dw = vec![0f32; cols];
        let mut db = vec![0f32; cols];
        for r in 0..rows {
            let (mu, rs) = (mean.as_ref().map_or(0.0, |m| m[r]), rstd[r]);
            for c in 0..cols {
                let d = dy[r * cols + c];
                dw[c] += d * (x[r * cols + c] - mu) * rs;
                db[c] += d;
            }
        }
        if let Some(t) = o.dweight {
            t.write_f32(&dw)?;
        }
        if let Some(t) = o.dbias {
            t.write_f32(&db)?;
        }
    }
    Ok(())
}
