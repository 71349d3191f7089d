//! `ferrite check softmax`: forward and backward of every variant against an f64 reference,
//! outputs poisoned first, odd widths, large logits (the max subtraction matters), scales.

use super::{softmax_backward_into, softmax_into, variants, SoftmaxOptions, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

/// (rows, cols, scale, logit range)
pub fn cases(quick: bool) -> Vec<(usize, usize, f32, f64)> {
    let mut v = vec![
        (1, 1, 1.0, 1.0),
        (7, 3, 0.5, 4.0),
        (127, 1000, 1.0, 30.0),
        (33, 4097, 0.125, 8.0),
        (64, 768, 1.0, 80.0),
        (5, 4096, 2.0, 3.0),
    ];
    if !quick {
        v.extend([
            (1000, 127, 1.0, 10.0),
            (4, 16384, 1.0, 10.0),
            (3, 32768, 0.7, 10.0),
            (2048, 1024, 1.0, 10.0),
        ]);
    }
    v
}

fn reference(x: &[f64], dy: &[f64], cols: usize, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    for r in 0..x.len() / cols {
        let row = &x[r * cols..][..cols];
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v * scale));
        let s: f64 = row.iter().map(|&v| (v * scale - m).exp()).sum();
        for c in 0..cols {
            y[r * cols + c] = (row[c] * scale - m).exp() / s;
        }
        let d: f64 = (0..cols).map(|c| dy[r * cols + c] * y[r * cols + c]).sum();
        for c in 0..cols {
            dx[r * cols + c] = scale * y[r * cols + c] * (dy[r * cols + c] - d);
        }
    }
    (y, dx)
}

fn check_one(
    dev: Device,
    dtype: DType,
    variant: &str,
    (rows, cols, scale, range): (usize, usize, f32, f64),
    seed: u64,
    with_backward: bool,
) -> Result<(f64, &'static str)> {
    let x = Tensor::rand(&[rows, cols], dtype, dev, seed, -range, range)?;
    let dy = Tensor::rand(&[rows, cols], dtype, dev, seed ^ 9, -1.0, 1.0)?;
    let (y, dx) = (
        Tensor::empty(&[rows, cols], dtype, dev)?,
        Tensor::empty(&[rows, cols], dtype, dev)?,
    );
    y.poison(None)?;
    dx.poison(None)?;
    let opts = SoftmaxOptions {
        variant: Some(variant.into()),
        scale,
        stream: None,
    };
    softmax_into(&x, &y, &opts)?;
    // The backward takes the forward's own (rounded) output, as training does.
    if with_backward {
        softmax_backward_into(&dy, &y, &dx, &opts)?;
    }
    let (ry, _) = reference(&x.to_f64_vec()?, &dy.to_f64_vec()?, cols, scale as f64);
    let (_, rdx) = {
        let yv = y.to_f64_vec()?;
        let g = dy.to_f64_vec()?;
        let mut dx_ref = vec![0.0; yv.len()];
        for r in 0..rows {
            let d: f64 = (0..cols).map(|c| g[r * cols + c] * yv[r * cols + c]).sum();
            for c in 0..cols {
                dx_ref[r * cols + c] = scale as f64 * yv[r * cols + c] * (g[r * cols + c] - d);
            }
        }
        (ry.clone(), dx_ref)
    };
    let ey = rel_error(&y.to_f64_vec()?, &ry);
    let edx = if with_backward {
        rel_error(&dx.to_f64_vec()?, &rdx)
    } else {
        0.0
    };
    Ok(if edx > ey || edx.is_nan() {
        (edx, "dx")
    } else {
        (ey, "y")
    })
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                for case in cases(cfg.quick) {
                    let p = super::Problem {
                        rows: case.0,
                        cols: case.1,
                        dtype,
                        device: dev,
                    };
                    if v.name == "vectorized" && super::vectorized_unfit(&p, &[], false).is_some() {
                        continue;
                    }
                    // Rows too wide for the variant's backward are checked forward only.
                    let bwd = !(v.name == "vectorized"
                        && super::vectorized_unfit(&p, &[], true).is_some());
                    let label =
                        format!("{}×{} scale {} logits ±{}", case.0, case.1, case.2, case.3);
                    out.push(
                        match check_one(dev, dtype, v.name, case, rng.next_u64(), bwd) {
                            Ok((e, worst)) => CheckRecord::compared(
                                OP,
                                v.name,
                                dev,
                                dtype,
                                Precision::of(dtype),
                                label,
                                e,
                                if bwd {
                                    format!("worst: {worst}")
                                } else {
                                    format!("worst: {worst}; forward only (backward cap)")
                                },
                            ),
                            Err(e) => {
                                CheckRecord::errored(OP, v.name, dev, dtype, label, e.to_string())
                            }
                        },
                    );
                }
            }
        }
    }
    Ok(())
}
