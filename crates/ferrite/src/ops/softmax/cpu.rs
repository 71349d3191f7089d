//! CPU softmax in fp32 on f32 copies of the rows. `naive`: one thread; `parallel`: rows across
//! cores (rayon), same arithmetic.

use super::Problem;
use crate::core::error::Result;
use crate::core::tensor::Tensor;
use rayon::prelude::*;

fn rows_map(variant: &str, rows: usize, f: impl Fn(usize) -> Vec<f32> + Sync + Send) -> Vec<f32> {
    if variant == "parallel" {
        (0..rows).into_par_iter().flat_map_iter(f).collect()
    } else {
        (0..rows).flat_map(f).collect()
    }
}

pub fn forward(variant: &str, p: &Problem, x: &Tensor, y: &Tensor, scale: f32) -> Result<()> {
    let xv = x.to_f32_vec()?;
    let c = p.cols;
    let out = rows_map(variant, p.rows, |r| {
        let row = &xv[r * c..][..c];
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        let e: Vec<f32> = row.iter().map(|&v| (v * scale - m).exp()).collect();
        // An f64 running sum: a plain f32 sum of 32k terms drifts by ~√n ulps.
        let inv = (1.0 / e.iter().map(|&v| v as f64).sum::<f64>()) as f32;
        e.into_iter().map(|v| v * inv).collect()
    });
    y.write_f32(&out)
}

pub fn backward(
    variant: &str,
    p: &Problem,
    dy: &Tensor,
    y: &Tensor,
    dx: &Tensor,
    scale: f32,
) -> Result<()> {
    let (g, yv) = (dy.to_f32_vec()?, y.to_f32_vec()?);
    let c = p.cols;
    let out = rows_map(variant, p.rows, |r| {
        let (gr, yr) = (&g[r * c..][..c], &yv[r * c..][..c]);
        let d = gr.iter().zip(yr).map(|(a, b)| (a * b) as f64).sum::<f64>() as f32;
        gr.iter()
            .zip(yr)
            .map(|(a, b)| scale * b * (a - d))
            .collect()
    });
    dx.write_f32(&out)
}
