//! CPU norms. Both variants compute in fp32 on f32 copies of the rows (16-bit inputs are widened
//! once) and round once on the way out.
//! `naive`: one thread; three passes over each row (mean, variance, normalise).
//! `parallel`: rows split across cores (rayon); the same arithmetic, so results match `naive`.

use super::{Bwd, BwdOut, Fwd, FwdOut, NormKind, Problem};
use crate::core::error::Result;
use rayon::prelude::*;

struct RowOut {
    y: Vec<f32>,
    h: Vec<f32>,
    mean: f32,
    rstd: f32,
}

fn forward_row(
    kind: NormKind,
    x: &[f32],
    res: Option<&[f32]>,
    w: Option<&[f32]>,
    b: Option<&[f32]>,
    eps: f32,
    round: impl Fn(f32) -> f32,
) -> RowOut {
    let n = x.len() as f32;
    let h: Vec<f32> = match res {
        Some(r) => x.iter().zip(r).map(|(a, b)| round(a + b)).collect(),
        None => x.to_vec(),
    };
    let mean = if kind == NormKind::Layer {
        h.iter().sum::<f32>() / n
    } else {
        0.0
    };
    let var = h.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let rstd = 1.0 / (var + eps).sqrt();
    let y = h
        .iter()
        .enumerate()
        .map(|(c, v)| {
            let mut o = (v - mean) * rstd;
            if let Some(w) = w {
                o *= w[c];
            }
            if let Some(b) = b {
                o += b[c];
            }
            o
        })
        .collect();
    RowOut { y, h, mean, rstd }
}

fn rounder(p: &Problem) -> fn(f32) -> f32 {
    match p.dtype {
        crate::DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        crate::DType::F16 => |v| half::f16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

pub fn forward(variant: &str, p: &Problem, i: &Fwd, o: &FwdOut, eps: f32) -> Result<()> {
    let x = i.x.to_f32_vec()?;
    let res = i.residual.map(|t| t.to_f32_vec()).transpose()?;
    let w = i.weight.map(|t| t.to_f32_vec()).transpose()?;
    let b = i.bias.map(|t| t.to_f32_vec()).transpose()?;
    let round = rounder(p);
    let cols = p.cols;
    let row = |r: usize| {
        forward_row(
            p.kind,
            &x[r * cols..][..cols],
            res.as_ref().map(|v| &v[r * cols..][..cols]),
            w.as_deref(),
            b.as_deref(),
            eps,
            round,
        )
    };
    let rows: Vec<RowOut> = if variant == "parallel" {
        (0..p.rows).into_par_iter().map(row).collect()
    } else {
        (0..p.rows).map(row).collect()
    };
    let mut y = Vec::with_capacity(p.rows * cols);
    for r in &rows {
        y.extend_from_slice(&r.y);
    }
    o.y.write_f32(&y)?;
    if let Some(h) = o.h {
        let hv: Vec<f32> = rows.iter().flat_map(|r| r.h.iter().copied()).collect();
        h.write_f32(&hv)?;
    }
    if let Some(m) = o.mean {
        m.write_f32(&rows.iter().map(|r| r.mean).collect::<Vec<_>>())?;
    }
    if let Some(s) = o.rstd {
        s.write_f32(&rows.iter().map(|r| r.rstd).collect::<Vec<_>>())?;
    }
    Ok(())
}

pub fn backward(variant: &str, p: &Problem, i: &Bwd, o: &BwdOut) -> Result<()> {
    let (dy, x) = (i.dy.to_f32_vec()?, i.x.to_f32_vec()?);
    let w = i.weight.map(|t| t.to_f32_vec()).transpose()?;
    let mean = i.mean.map(|t| t.to_f32_vec()).transpose()?;
    let rstd = i.rstd.to_f32_vec()?;
    let (rows, cols) = (p.rows, p.cols);
    let n = cols as f32;
    let layer = p.kind == NormKind::Layer;
    let row = |r: usize| -> Vec<f32> {
        let (d, xr) = (&dy[r * cols..][..cols], &x[r * cols..][..cols]);
        let (mu, rs) = (mean.as_ref().map_or(0.0, |m| m[r]), rstd[r]);
        let g = |c: usize| d[c] * w.as_ref().map_or(1.0, |w| w[c]);
        let xh = |c: usize| (xr[c] - mu) * rs;
        let mg = if layer {
            (0..cols).map(g).sum::<f32>() / n
        } else {
            0.0
        };
        let mgx = (0..cols).map(|c| g(c) * xh(c)).sum::<f32>() / n;
        (0..cols).map(|c| rs * (g(c) - mg - xh(c) * mgx)).collect()
    };
    let dx: Vec<f32> = if variant == "parallel" {
        (0..rows).into_par_iter().flat_map_iter(row).collect()
    } else {
        (0..rows).flat_map(row).collect()
    };
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
