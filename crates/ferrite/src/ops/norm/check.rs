//! `ferrite check norm`: forward (y, h, mean, rstd) and backward (dx, dw, db) of every variant
//! against an f64 reference, outputs poisoned first, odd widths, with and without weight, bias and
//! residual.

use super::{
    backward_into, forward_into, variants, vectorized_bwd_fits, vectorized_fits, Bwd, BwdOut, Fwd,
    FwdOut, NormKind, NormOptions, Problem, OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::{rel_error, rel_error_scaled};
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub kind: NormKind,
    pub rows: usize,
    pub cols: usize,
    pub weight: bool,
    pub bias: bool,
    pub residual: bool,
}

impl Case {
    pub fn label(&self) -> String {
        let mut s = format!(
            "{} {}×{}",
            if self.kind == NormKind::Rms {
                "rms"
            } else {
                "layer"
            },
            self.rows,
            self.cols
        );
        for (on, tag) in [
            (self.weight, "+w"),
            (self.bias, "+b"),
            (self.residual, "+res"),
        ] {
            if on {
                s.push_str(tag);
            }
        }
        s
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    let mut shapes = vec![
        (1, 1),
        (7, 3),
        (127, 1000),
        (33, 4097),
        (64, 768),
        (5, 4096),
    ];
    if !quick {
        shapes.extend([(1000, 127), (4, 16384), (3, 32768), (2048, 1024)]);
    }
    let mut v = Vec::new();
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        // Rotate the optional parts so every combination appears across the shapes.
        let (w, b, r) = (i % 3 != 2, i % 2 == 0, i % 3 != 1);
        // One or two columns are degenerate for the backward: LayerNorm's x̂ is 0 (one column) or
        // ±1 (two), so its dx is exactly 0 and only rounding noise is compared; RMSNorm's single
        // column has x̂ = ±1 and a dx of nearly cancelling terms. Widen them.
        let layer_cols = if cols <= 2 { 3 } else { cols };
        v.push(Case {
            kind: NormKind::Layer,
            rows,
            cols: layer_cols,
            weight: w,
            bias: b,
            residual: r,
        });
        let rms_cols = if cols <= 2 { 3 } else { cols };
        v.push(Case {
            kind: NormKind::Rms,
            rows,
            cols: rms_cols,
            weight: !w || i == 0,
            bias: false,
            residual: !r || i == 0,
        });
    }
    v
}

fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

/// f64 reference: (h, y, mean, rstd, dx, dw, db).
#[allow(clippy::type_complexity)]
fn reference(
    c: &Case,
    dtype: DType,
    x: &[f64],
    res: Option<&[f64]>,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    dy: &[f64],
    eps: f64,
) -> (
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
) {
    let (rows, cols) = (c.rows, c.cols);
    let n = cols as f64;
    let h: Vec<f64> = match res {
        Some(r) => x
            .iter()
            .zip(r)
            .map(|(a, b)| round_to(dtype, a + b))
            .collect(),
        None => x.to_vec(),
    };
    let (mut y, mut mean, mut rstd, mut dx) = (
        vec![0.0; rows * cols],
        vec![0.0; rows],
        vec![0.0; rows],
        vec![0.0; rows * cols],
    );
    let (mut dw, mut db) = (vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        let hr = &h[r * cols..][..cols];
        let mu = if c.kind == NormKind::Layer {
            hr.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let var = hr.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n;
        let rs = 1.0 / (var + eps).sqrt();
        mean[r] = mu;
        rstd[r] = rs;
        let wv = |j: usize| w.map_or(1.0, |w| w[j]);
        let xh = |j: usize| (hr[j] - mu) * rs;
        let d = &dy[r * cols..][..cols];
        let mg = if c.kind == NormKind::Layer {
            (0..cols).map(|j| d[j] * wv(j)).sum::<f64>() / n
        } else {
            0.0
        };
        let mgx = (0..cols).map(|j| d[j] * wv(j) * xh(j)).sum::<f64>() / n;
        for j in 0..cols {
            y[r * cols + j] = xh(j) * wv(j) + b.map_or(0.0, |b| b[j]);
            dx[r * cols + j] = rs * (d[j] * wv(j) - mg - xh(j) * mgx);
            dw[j] += d[j] * xh(j);
            db[j] += d[j];
        }
    }
    (h, y, mean, rstd, dx, dw, db)
}

fn poisoned(shape: &[usize], dtype: DType, dev: Device) -> Result<Tensor> {
    let t = Tensor::empty(shape, dtype, dev)?;
    t.poison(None)?;
    Ok(t)
}

/// Runs one case with one variant; returns the worst relative error and which output it was.
fn check_one(
    c: &Case,
    dev: Device,
    dtype: DType,
    variant: &str,
    seed: u64,
    with_backward: bool,
) -> Result<(f64, String)> {
    let (rows, cols) = (c.rows, c.cols);
    let eps = 1e-5f32;
    let shape = [rows, cols];
    let x = Tensor::rand(&shape, dtype, dev, seed, -1.0, 2.0)?;
    let res = c
        .residual
        .then(|| Tensor::rand(&shape, dtype, dev, seed ^ 1, -1.0, 1.0))
        .transpose()?;
    let w = c
        .weight
        .then(|| Tensor::rand(&[cols], dtype, dev, seed ^ 2, 0.5, 1.5))
        .transpose()?;
    let b = c
        .bias
        .then(|| Tensor::rand(&[cols], dtype, dev, seed ^ 3, -0.5, 0.5))
        .transpose()?;
    let dy = Tensor::rand(&shape, dtype, dev, seed ^ 4, -1.0, 1.0)?;
    let layer = c.kind == NormKind::Layer;
    let y = poisoned(&shape, dtype, dev)?;
    let h = c
        .residual
        .then(|| poisoned(&shape, dtype, dev))
        .transpose()?;
    let mean = layer
        .then(|| poisoned(&[rows], DType::F32, dev))
        .transpose()?;
    let rstd = poisoned(&[rows], DType::F32, dev)?;
    let opts = NormOptions {
        variant: Some(variant.into()),
        eps,
        stream: None,
    };
    forward_into(
        c.kind,
        &Fwd {
            x: &x,
            residual: res.as_ref(),
            weight: w.as_ref(),
            bias: b.as_ref(),
        },
        &FwdOut {
            y: &y,
            h: h.as_ref(),
            mean: mean.as_ref(),
            rstd: Some(&rstd),
        },
        &opts,
    )?;
    let normed = h.as_ref().unwrap_or(&x);
    let dx = poisoned(&shape, dtype, dev)?;
    let dw = c
        .weight
        .then(|| poisoned(&[cols], dtype, dev))
        .transpose()?;
    let db = c.bias.then(|| poisoned(&[cols], dtype, dev)).transpose()?;
    if with_backward {
        backward_into(
            c.kind,
            &Bwd {
                dy: &dy,
                x: normed,
                weight: w.as_ref(),
                mean: mean.as_ref(),
                rstd: &rstd,
            },
            &BwdOut {
                dx: &dx,
                dweight: dw.as_ref(),
                dbias: db.as_ref(),
            },
            &opts,
        )?;
    }
    if let Device::Cuda(i) = dev {
        let d = crate::core::cuda::device(i)?;
        d.synchronize(d.stream(), &format!("norm/{variant}"))?;
    }
    let f = |t: &Tensor| t.to_f64_vec();
    let (rh, ry, rmean, rrstd, rdx, rdw, rdb) = reference(
        c,
        dtype,
        &f(&x)?,
        res.as_ref().map(f).transpose()?.as_deref(),
        w.as_ref().map(f).transpose()?.as_deref(),
        b.as_ref().map(f).transpose()?.as_deref(),
        &f(&dy)?,
        eps as f64,
    );
    let mut worst = (0.0f64, String::new());
    let mut keep = |name: &str, e: f64| {
        if e > worst.0 || (e.is_nan() && !worst.0.is_nan()) {
            worst = (e, name.to_string());
        }
    };
    let mut cmp = |name: &str, got: Option<&Tensor>, want: &[f64]| -> Result<()> {
        if let Some(t) = got {
            keep(name, rel_error(&t.to_f64_vec()?, want));
        }
        Ok(())
    };
    cmp("y", Some(&y), &ry)?;
    cmp("h", h.as_ref(), &rh)?;
    cmp("mean", mean.as_ref(), &rmean)?;
    cmp("rstd", Some(&rstd), &rrstd)?;
    if with_backward {
        // dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w cancels: on short rows it can be
        // far smaller than its terms (a row of 3 keeps one degree of freedom of g), and a correct
        // kernel's rounding error scales with the terms, rstd·|g|. Its error is measured against
        // the larger of ‖dx‖ and ‖rstd·g‖, so ill-conditioned draws do not fail a right answer.
        let dyv = f(&dy)?;
        let wv = w.as_ref().map(f).transpose()?;
        let terms: f64 = dyv
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                let gw = g * wv.as_ref().map_or(1.0, |w| w[i % c.cols]);
                (gw * rrstd[i / c.cols]).powi(2)
            })
            .sum::<f64>()
            .sqrt();
        cmp("dw", dw.as_ref(), &rdw)?;
        cmp("db", db.as_ref(), &rdb)?;
        keep("dx", rel_error_scaled(&dx.to_f64_vec()?, &rdx, terms));
    }
    Ok(worst)
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                for c in cases(cfg.quick) {
                    let p = Problem {
                        kind: c.kind,
                        rows: c.rows,
                        cols: c.cols,
                        dtype,
                        device: dev,
                    };
                    // Shapes a variant declines by its stated constraints are not its cases.
                    if v.name == "vectorized" && vectorized_fits(&p, &[]).is_some() {
                        continue;
                    }
                    let prec = Precision::of(dtype);
                    // Rows too wide for the variant's backward are checked forward only.
                    let bwd = !(v.name == "vectorized" && vectorized_bwd_fits(&p, &[]).is_some());
                    let rec = match check_one(&c, dev, dtype, v.name, rng.next_u64(), bwd) {
                        Ok((e, worst)) => CheckRecord::compared(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            prec,
                            c.label(),
                            e,
                            if bwd {
                                format!("worst: {worst}")
                            } else {
                                format!("worst: {worst}; forward only (backward cap)")
                            },
                        ),
                        Err(e) => {
                            CheckRecord::errored(OP, v.name, dev, dtype, c.label(), e.to_string())
                        }
                    };
                    out.push(rec);
                }
            }
        }
    }
    Ok(())
}
