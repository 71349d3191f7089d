//! CPU paths of the linear family: `naive` (reference loops, one thread) and `parallel` (matmul's
//! packed multi-core SIMD GEMM plus one fused epilogue pass). bf16/f16 are widened to f32, computed
//! in f32 and rounded once on the way out.

use super::{rows_view, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions, Problem, OP, OP_BWD};
use crate::core::cpu::{with_f32, with_f32_out};
use crate::core::error::Result;
use crate::core::host;
use crate::ops::matmul::{cpu as mm, epilogue};
use rayon::prelude::*;

/// Rows per partial sum of the bias gradient: fixed, so the summation order (and the bits) do not
/// depend on the thread count.
pub const DB_CHUNK: usize = 256;

/// Reference forward loops: one f32 dot product per output, X rows against W rows.
fn gemm_rows_naive(xs: &[f32], ws: &[f32], ys: &mut [f32], m: usize, n: usize, k: usize) {
    for i in 0..m {
        let xr = &xs[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &ws[j * k..(j + 1) * k];
            let mut acc = 0f32;
            for p in 0..k {
                acc += xr[p] * wr[p];
            }
            ys[i * n + j] = acc;
        }
    }
}

pub fn forward(
    variant: &str,
    p: &Problem,
    i: &Fwd,
    o: &FwdOut,
    opts: &LinearOptions,
) -> Result<()> {
    let parallel = variant == "parallel";
    let (m, n, k) = (p.m, p.n, p.k);
    let x2 = rows_view(OP, "x", i.x)?;
    let bias = i.bias.map(|b| b.to_f32_vec()).transpose()?;
    let res = match i.residual {
        Some(r) => Some(rows_view(OP, "residual", r)?.to_f32_vec()?),
        None => None,
    };
    let mut z =
        o.z.map(|_| host::zeroed::<f32>(m * n, "linear: the CPU path's Z buffer"))
            .transpose()?;
    with_f32(&x2, |xs| {
        with_f32(i.w, |ws| {
            with_f32_out(o.y, |ys| {
                if parallel {
                    mm::product(
                        true,
                        opts.threads,
                        (m, n, k),
                        xs,
                        k,
                        false,
                        ws,
                        k,
                        true,
                        ys,
                        n,
                    );
                } else {
                    gemm_rows_naive(xs, ws, ys, m, n, k);
                }
                epilogue::apply_rows(
                    ys,
                    n,
                    m,
                    n,
                    bias.as_deref(),
                    opts.activation,
                    z.as_mut().map(|z| (&mut z[..], n)),
                    res.as_deref().map(|r| (r, n)),
                    parallel,
                );
            })
        })
    })???;
    if let (Some(zt), Some(z)) = (o.z, z) {
        zt.write_f32(&z)?;
    }
    Ok(())
}

/// dZ = dY ⊙ act'(Z) in place over rows of `n`.
fn dz_in_place(dz: &mut [f32], z: Option<&[f32]>, act: Activation, n: usize, parallel: bool) {
    let (Some(z), true) = (z, act != Activation::None) else {
        return;
    };
    let n = n.max(1);
    let row = |(d, zr): (&mut [f32], &[f32])| {
        for (d, &zv) in d.iter_mut().zip(zr) {
            *d *= act.grad(zv);
        }
    };
    if parallel {
        dz.par_chunks_mut(n).zip(z.par_chunks(n)).for_each(row);
    } else {
        dz.chunks_mut(n).zip(z.chunks(n)).for_each(row);
    }
}

/// `db[j] = Σ_i dz[i][j]`: f64 partial sums over fixed chunks of DB_CHUNK rows, then the partials
/// in chunk order. The chunks, not the threads, fix the order: same bits on every run.
pub fn column_sums(dz: &[f32], m: usize, n: usize, parallel: bool) -> Vec<f32> {
    if n == 0 {
        return vec![];
    }
    let chunk = |rows: &[f32]| {
        let mut s = vec![0f64; n];
        for r in rows.chunks(n) {
            for (s, &v) in s.iter_mut().zip(r) {
                *s += v as f64;
            }
        }
        s
    };
    let dz = &dz[..m * n];
    let partials: Vec<Vec<f64>> = if parallel {
        dz.par_chunks(DB_CHUNK * n).map(chunk).collect()
    } else {
        dz.chunks(DB_CHUNK * n).map(chunk).collect()
    };
    (0..n)
        .map(|j| partials.iter().map(|p| p[j]).sum::<f64>() as f32)
        .collect()
}

pub fn backward(
    variant: &str,
    p: &Problem,
    i: &Bwd,
    o: &BwdOut,
    opts: &LinearOptions,
) -> Result<()> {
    let parallel = variant == "parallel";
    let (m, n, k, th) = (p.m, p.n, p.k, opts.threads);
    let mut dz = rows_view(OP_BWD, "dy", i.dy)?.to_f32_vec()?;
    let z = match (opts.activation, i.z) {
        (Activation::None, _) | (_, None) => None,
        (_, Some(z)) => Some(rows_view(OP_BWD, "z", z)?.to_f32_vec()?),
    };
    dz_in_place(&mut dz, z.as_deref(), opts.activation, n, parallel);
    if let Some(db) = o.db {
        db.write_f32(&column_sums(&dz, m, n, parallel))?;
    }
    if let Some(dx) = o.dx {
        // dX [m, k] = dZ [m, n] · W [n, k]
        let z_in = match i.x_pre {
            Some((z, act)) if act != Activation::None => {
                Some((rows_view(OP_BWD, "x_pre", z)?.to_f32_vec()?, act))
            }
            _ => None,
        };
        with_f32(i.w, |ws| {
            with_f32_out(dx, |d| {
                mm::product(parallel, th, (m, k, n), &dz, n, false, ws, k, false, d, k);
                // The layer below's dZ: dX ⊙ act_in'(Z_in), before the one rounding to dx.
                if let Some((z, act)) = &z_in {
                    dz_in_place(d, Some(z), *act, k, parallel);
                }
            })
        })??;
        if let Some(dbp) = o.db_pre {
            // The layer below's bias gradient: column sums of dx as stored (rounded), as the GPU
            // epilogue sums its staged tiles.
            dbp.write_f32(&column_sums(&dx.to_f32_vec()?, m, k, parallel))?;
        }
    }
    if let Some(dw) = o.dw {
        // dW [n, k] = dZᵀ [n, m] · X [m, k]
        let x2 = rows_view(OP_BWD, "x", i.x)?;
        with_f32(&x2, |xs| {
            with_f32_out(dw, |d| {
                mm::product(parallel, th, (n, k, m), &dz, n, true, xs, k, false, d, k)
            })
        })??;
    }
    Ok(())
}
