//! The epilogue hook: what a GEMM may do to each output element on its way out, so that a linear
//! layer's bias, activation and residual cost no extra pass over memory.
//!
//! For C(i, j) = α·acc + β·C(i, j) (the plain GEMM value, fp32), the epilogue computes
//!
//! ```text
//! v = C(i, j) + bias[j]          (bias: one value per output column, optional)
//! Z(i, j) = v                    (pre-activation, optional: what the backward needs)
//! C(i, j) = act(v) + R(i, j)     (R: residual, optional)
//! ```
//!
//! all in fp32 with one rounding to the output dtype (Z is rounded to it once too). The CUDA
//! kernels `naive`, `mma`/`mma_pipelined` and `wgmma` apply it in their store step when compiled
//! with `-DFE_EPI=1+activation` (`cuda::plan_epilogue` / `cuda::launch_with_epilogue`); without the
//! define the code is compiled out and the plain GEMM is unchanged. On the CPU, [`apply_rows`] is
//! a pass over the output after the GEMM (the tile is still in cache for small outputs).

use rayon::prelude::*;

pub use crate::core::act::Activation;

/// Device addresses and layouts of the epilogue's tensors (0 = absent). Z and R are indexed like
/// C: element (batch b, row i, column j) at `b·stride + i·ld + j`; the bias at `j` for every batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct EpiPtrs {
    /// The bias, one value per output column.
    pub bias: u64,
    /// Where the pre-activation Z goes.
    pub z: u64,
    /// Z's row stride, elements.
    pub ldz: usize,
    /// Z's batch stride, elements.
    pub stride_z: usize,
    /// The residual R added after the activation.
    pub r: u64,
    /// R's row stride, elements.
    pub ldr: usize,
    /// R's batch stride, elements.
    pub stride_r: usize,
    /// The activation-backward epilogue only (`Epi::dact`): f32 column sums of C per 16-row
    /// group, `part[i / 16][j]` with rows n floats apart (0 = not wanted). Only for launches
    /// whose every tile takes the TMA-store pair path (`dact_colsum_ok`).
    pub part: u64,
}

/// The CPU epilogue over an m×n f32 output `c` (rows `ldc` apart, already holding the GEMM
/// value): bias, optional Z (rows `ldz` apart), activation, optional residual (rows `ldr` apart).
/// Rows run in parallel when `parallel`; every row is computed by the same code either way.
#[allow(clippy::too_many_arguments)]
pub fn apply_rows(
    c: &mut [f32],
    ldc: usize,
    m: usize,
    n: usize,
    bias: Option<&[f32]>,
    act: Activation,
    z: Option<(&mut [f32], usize)>,
    r: Option<(&[f32], usize)>,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let row = |i: usize, crow: &mut [f32], zrow: Option<&mut [f32]>| {
        let rrow = r.map(|(r, ldr)| &r[i * ldr..i * ldr + n]);
        let mut zrow = zrow;
        for j in 0..n {
            let mut v = crow[j];
            if let Some(b) = bias {
                v += b[j];
            }
            if let Some(zr) = zrow.as_deref_mut() {
                zr[j] = v;
            }
            v = act.apply(v);
            if let Some(rr) = rrow {
                v += rr[j];
            }
            crow[j] = v;
        }
    };
    let ldc = ldc.max(n);
    let c = &mut c[..(m - 1) * ldc + n];
    match z {
        Some((z, ldz)) => {
            let ldz = ldz.max(n);
            let z = &mut z[..(m - 1) * ldz + n];
            if parallel {
                c.par_chunks_mut(ldc)
                    .zip(z.par_chunks_mut(ldz))
                    .enumerate()
                    .for_each(|(i, (cr, zr))| row(i, &mut cr[..n], Some(&mut zr[..n])));
            } else {
                c.chunks_mut(ldc)
                    .zip(z.chunks_mut(ldz))
                    .enumerate()
                    .for_each(|(i, (cr, zr))| row(i, &mut cr[..n], Some(&mut zr[..n])));
            }
        }
        None => {
            if parallel {
                c.par_chunks_mut(ldc)
                    .enumerate()
                    .for_each(|(i, cr)| row(i, &mut cr[..n], None));
            } else {
                c.chunks_mut(ldc)
                    .enumerate()
                    .for_each(|(i, cr)| row(i, &mut cr[..n], None));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grads_match_finite_differences() {
        for a in Activation::ALL {
            for &v in &[-3.1, -0.7, -0.01, 0.3, 1.2, 2.9] {
                let h = 1e-6;
                let fd = (a.apply_f64(v + h) - a.apply_f64(v - h)) / (2.0 * h);
                assert!(
                    (fd - a.grad_f64(v)).abs() < 1e-6,
                    "{a} at {v}: {fd} vs {}",
                    a.grad_f64(v)
                );
                assert!(
                    (a.apply(v as f32) as f64 - a.apply_f64(v)).abs() < 1e-6,
                    "{a} f32 at {v}"
                );
            }
        }
    }

    #[test]
    fn cpu_pass_applies_bias_z_act_residual() {
        // 2×3 output with row pitch 4, Z pitch 3, residual pitch 5.
        let mut c = vec![1.0, -2.0, 0.5, 9.0, -1.0, 3.0, 0.0, 9.0];
        let bias = [0.5, 0.5, -1.0];
        let mut z = vec![f32::NAN; 6];
        let r = [1.0, 2.0, 3.0, 0.0, 0.0, 10.0, 20.0, 30.0, 0.0, 0.0];
        apply_rows(
            &mut c,
            4,
            2,
            3,
            Some(&bias),
            Activation::Relu,
            Some((&mut z, 3)),
            Some((&r, 5)),
            false,
        );
        assert_eq!(z, vec![1.5, -1.5, -0.5, -0.5, 3.5, -1.0]);
        assert_eq!(&c[..3], &[2.5, 2.0, 3.0]);
        assert_eq!(c[3], 9.0, "padding untouched");
        assert_eq!(&c[4..7], &[10.0, 23.5, 30.0]);
    }
}
