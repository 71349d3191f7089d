//! CPU cross-entropy: fp32 inputs (16-bit widened), log-sum-exp and row sums in f64. `naive`:
//! one thread; `parallel`: rows across cores (rayon) through the same row function, so the
//! results are identical; `simd`: `parallel` with the exponentials in f32 through the vectorised
//! `core::cpu::exp_in_place` (two per logit: the sum and the gradient). Targets are checked before anything is written.

use super::{bad_target, CrossEntropyOptions, GradOut, Problem, Reduction};
use crate::core::cpu::{exp_in_place, max_lanes, sum_lanes, with_f32, with_f32_out};
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::host;
use crate::core::tensor::Tensor;
use rayon::prelude::*;

/// The targets as i64 (i32 widened).
pub fn target_vec(t: &Tensor) -> Result<Vec<i64>> {
    Ok(match t.dtype() {
        DType::I32 => t.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        _ => t.to_vec::<i64>()?,
    })
}

struct Row<'a> {
    x: &'a [f32],
    t: i64,
}

/// Loss of one row, writing its gradient into `g` (when not empty); `simd` hands it to `row_simd`.
fn row(r: Row, g: &mut [f32], ignore: i64, eps: f64, scale: f64, simd: bool) -> f32 {
    let v = r.x.len();
    if r.t == ignore {
        g.iter_mut().for_each(|o| *o = 0.0);
        return 0.0;
    }
    let t = r.t as usize; // checked in [0, V) by the caller
    let off = eps / v as f64;
    if simd {
        return row_simd(r.x, t, g, eps, off, scale);
    }
    let m = r.x.iter().fold(f64::NEG_INFINITY, |m, &a| m.max(a as f64));
    let s: f64 = r.x.iter().map(|&a| (a as f64 - m).exp()).sum();
    let lse = m + s.ln();
    let sx: f64 = r.x.iter().map(|&a| a as f64).sum();
    if !g.is_empty() {
        for (j, (o, &a)) in g.iter_mut().zip(r.x).enumerate() {
            let hit = if j == t { 1.0 - eps } else { 0.0 };
            *o = (scale * ((a as f64 - lse).exp() - off - hit)) as f32;
        }
    }
    // Without smoothing the other classes carry no weight: skip the term (a masked −inf logit
    // would make it 0·(−inf) = NaN).
    let smooth = if eps > 0.0 { off * sx } else { 0.0 };
    (lse - (1.0 - eps) * r.x[t] as f64 - smooth) as f32
}

/// `row` for `simd`: max and sums over 16 f32 lanes (`max_lanes`, `sum_lanes`: block partials in
/// f64), the exponentials through `exp_in_place`, the gradient in f32; the loss itself in f64.
fn row_simd(x: &[f32], t: usize, g: &mut [f32], eps: f64, off: f64, scale: f64) -> f32 {
    let m = max_lanes(x);
    let mut buf = [0f32; 1024];
    let s: f64 = x
        .chunks(buf.len())
        .map(|c| {
            let b = &mut buf[..c.len()];
            b.iter_mut().zip(c).for_each(|(o, &a)| *o = a - m);
            exp_in_place(b);
            sum_lanes(b)
        })
        .sum();
    let lse = m as f64 + s.ln();
    if !g.is_empty() {
        g.iter_mut().zip(x).for_each(|(o, &a)| *o = a - lse as f32);
        exp_in_place(g);
        let (sc, of) = (scale as f32, off as f32);
        g.iter_mut().for_each(|o| *o = sc * (*o - of));
        g[t] -= sc * (1.0 - eps) as f32;
    }
    let smooth = if eps > 0.0 { off * sum_lanes(x) } else { 0.0 };
    (lse - (1.0 - eps) * x[t] as f64 - smooth) as f32
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    variant: &str,
    p: &Problem,
    logits: &Tensor,
    targets: &Tensor,
    loss_rows: &Tensor,
    loss: Option<&Tensor>,
    grad: GradOut,
    opts: &CrossEntropyOptions,
) -> Result<()> {
    let (n, v) = (p.rows, p.vocab);
    let tg = target_vec(targets)?;
    let ignore = opts.ignore_index;
    if let Some((r, &t)) = tg
        .iter()
        .enumerate()
        .find(|(_, &t)| t != ignore && !(0..v as i64).contains(&t))
    {
        return Err(bad_target(r, t, p, ignore));
    }
    let count = tg.iter().filter(|&&t| t != ignore).count();
    let scale = match opts.reduction {
        Reduction::Mean => opts.dloss as f64 / count as f64,
        _ => opts.dloss as f64,
    };
    let eps = opts.label_smoothing as f64;
    // Small problems stay on this thread (see core::cpu::PAR_MIN_ELEMS).
    let parallel = variant != "naive" && n * v >= crate::core::cpu::PAR_MIN_ELEMS;
    let simd = variant == "simd";
    let mut lr = host::zeroed::<f32>(n, "cross_entropy: the CPU path's per-row losses")?;
    let compute = |x: &[f32], g: &mut [f32], lr: &mut [f32]| {
        let one = |i: usize, gr: &mut [f32]| {
            let r = Row {
                x: &x[i * v..][..v],
                t: tg[i],
            };
            row(r, gr, ignore, eps, scale, simd)
        };
        match (g.is_empty(), parallel) {
            (true, true) => lr
                .par_iter_mut()
                .enumerate()
                .for_each(|(i, l)| *l = one(i, &mut [])),
            (true, false) => lr
                .iter_mut()
                .enumerate()
                .for_each(|(i, l)| *l = one(i, &mut [])),
            (false, true) => lr
                .par_iter_mut()
                .zip(g.par_chunks_mut(v))
                .enumerate()
                .for_each(|(i, (l, gr))| *l = one(i, gr)),
            (false, false) => lr
                .iter_mut()
                .zip(g.chunks_mut(v))
                .enumerate()
                .for_each(|(i, (l, gr))| *l = one(i, gr)),
        }
    };
    match grad {
        GradOut::Skip => with_f32(logits, |x| compute(x, &mut [], &mut lr))?,
        GradOut::Into(g) => with_f32(logits, |x| with_f32_out(g, |gb| compute(x, gb, &mut lr)))??,
        GradOut::InPlace => {
            let x = logits.to_f32_vec()?;
            with_f32_out(logits, |gb| compute(&x, gb, &mut lr))?
        }
    }
    loss_rows.with_cpu_mut::<f32, _>(|o| o[..n].copy_from_slice(&lr))?;
    if let Some(l) = loss {
        let s: f64 = lr.iter().map(|&a| a as f64).sum();
        let val = match opts.reduction {
            Reduction::Mean => s / count as f64,
            _ => s,
        };
        l.with_cpu_mut::<f32, _>(|o| o[0] = val as f32)?;
    }
    Ok(())
}
