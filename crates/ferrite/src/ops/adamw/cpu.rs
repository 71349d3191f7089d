//! CPU AdamW in fp32, the kernels' arithmetic exactly (`update` mirrors the .cu), so CPU and GPU
//! agree to rounding. `naive`: one thread; `parallel`: 64K-element chunks across cores.

use super::{AdamWTensor, Hyper};
use crate::core::cpu::with_f32;
use crate::core::dtype::DType;
use crate::core::error::Result;
use half::bf16;
use rayon::prelude::*;

#[inline]
pub fn update(p: &mut f32, m: &mut f32, v: &mut f32, gr: f32, h: &Hyper) {
    let g = gr * h.grad_scale;
    *m += h.one_minus_beta1 * (g - *m);
    *v = h.beta2 * *v + h.one_minus_beta2 * g * g;
    *p *= h.decay;
    *p -= h.step_size * *m / (v.sqrt() * h.inv_bc2_sqrt + h.eps);
}

const CHUNK: usize = 1 << 16;

/// Runs `f(range start, chunk of each slice)` over equal chunks of four slices.
fn chunks4<F>(parallel: bool, a: &mut [f32], b: &mut [f32], c: &mut [f32], g: &[f32], f: F)
where
    F: Fn(&mut [f32], &mut [f32], &mut [f32], &[f32]) + Sync + Send,
{
    let it = |(((a, b), c), g): (((&mut [f32], &mut [f32]), &mut [f32]), &[f32])| f(a, b, c, g);
    if parallel {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks_mut(CHUNK))
            .zip(c.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(it);
    } else {
        a.chunks_mut(CHUNK)
            .zip(b.chunks_mut(CHUNK))
            .zip(c.chunks_mut(CHUNK))
            .zip(g.chunks(CHUNK))
            .for_each(it);
    }
}

pub fn step(variant: &str, ts: &[AdamWTensor], h: &Hyper) -> Result<()> {
    let parallel = variant == "parallel";
    for t in ts {
        let n = t.param.numel();
        with_f32(t.grad, |g| -> Result<()> {
            t.exp_avg.with_cpu_mut::<f32, _>(|m| {
                t.exp_avg_sq.with_cpu_mut::<f32, _>(|v| -> Result<()> {
                    let (m, v) = (&mut m[..n], &mut v[..n]);
                    let body = |p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]| {
                        for i in 0..p.len() {
                            update(&mut p[i], &mut m[i], &mut v[i], g[i], h);
                        }
                    };
                    if t.param.dtype() == DType::F32 {
                        t.param.with_cpu_mut::<f32, _>(|p| {
                            chunks4(parallel, &mut p[..n], m, v, g, body)
                        })
                    } else {
                        let master = t.master.expect("validated: bf16 params have a master");
                        master.with_cpu_mut::<f32, _>(|w| {
                            chunks4(parallel, &mut w[..n], m, v, g, body);
                            t.param.with_cpu_mut::<bf16, _>(|p| {
                                p[..n]
                                    .iter_mut()
                                    .zip(&w[..n])
                                    .for_each(|(o, &x)| *o = bf16::from_f32(x))
                            })
                        })?
                    }
                })
            })??
        })??;
    }
    Ok(())
}
