//! CPU softmax in fp32 (16-bit inputs widened), sums in f64. `naive`: one thread; `parallel`:
//! rows across cores (rayon), same arithmetic and so the same results; `simd`: `parallel` with
//! the exponentials vectorised (`core::cpu::exp_in_place`, ≤ 2 ulp, 16 lanes with AVX-512)
//! instead of libm's scalar `expf`. The backward has no exponential: `simd` runs `parallel`'s.
//! f32 tensors are read and written in place.

use super::Problem;
use crate::core::cpu::{
    exp_in_place, for_rows, max_lanes, sum_f64, sum_lanes, with_f32, with_f32_out,
};
use crate::core::error::Result;
use crate::core::tensor::Tensor;

pub fn forward(variant: &str, p: &Problem, x: &Tensor, y: &Tensor, scale: f32) -> Result<()> {
    let c = p.cols;
    let mut unit = vec![(); p.rows];
    let simd = variant == "simd";
    with_f32(x, |xv| {
        with_f32_out(y, |out| {
            for_rows(variant != "naive", c, out, &mut unit, |r, o, _| {
                let row = &xv[r * c..][..c];
                if simd {
                    // max(x·scale) = max(x)·scale for scale > 0.
                    let m = if scale > 0.0 {
                        max_lanes(row) * scale
                    } else {
                        row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale))
                    };
                    for (oi, &v) in o.iter_mut().zip(row) {
                        *oi = v * scale - m;
                    }
                    exp_in_place(o);
                    let inv = (1.0 / sum_lanes(o)) as f32;
                    o.iter_mut().for_each(|v| *v *= inv);
                    return;
                }
                let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
                for (oi, &v) in o.iter_mut().zip(row) {
                    *oi = (v * scale - m).exp();
                }
                let inv = (1.0 / sum_f64(o.iter().copied())) as f32;
                o.iter_mut().for_each(|v| *v *= inv);
            })
        })
    })?
}

pub fn backward(
    variant: &str,
    p: &Problem,
    dy: &Tensor,
    y: &Tensor,
    dx: &Tensor,
    scale: f32,
) -> Result<()> {
    let c = p.cols;
    let mut unit = vec![(); p.rows];
    with_f32(dy, |g| {
        with_f32(y, |yv| {
            with_f32_out(dx, |out| {
                for_rows(variant != "naive", c, out, &mut unit, |r, o, _| {
                    let (gr, yr) = (&g[r * c..][..c], &yv[r * c..][..c]);
                    let d = sum_f64(gr.iter().zip(yr).map(|(a, b)| a * b)) as f32;
                    for ((oi, a), b) in o.iter_mut().zip(gr).zip(yr) {
                        *oi = scale * b * (a - d);
                    }
                })
            })
        })
    })??
}
