//! CPU helpers shared by the row-wise op families.

use rayon::prelude::*;

/// Runs `f(row, out_row, slot)` for every row of `out` (rows of `cols` elements), serially or
/// split across cores; each row gets its own slot of `per_row`. Every row is computed by the same
/// code either way, so serial and parallel results are identical.
pub fn for_rows<S: Send, F>(parallel: bool, cols: usize, out: &mut [f32], per_row: &mut [S], f: F)
where
    F: Fn(usize, &mut [f32], &mut S) + Sync + Send,
{
    let cols = cols.max(1);
    if parallel {
        out.par_chunks_mut(cols)
            .zip(per_row.par_iter_mut())
            .enumerate()
            .for_each(|(r, (o, s))| f(r, o, s));
    } else {
        out.chunks_mut(cols)
            .zip(per_row.iter_mut())
            .enumerate()
            .for_each(|(r, (o, s))| f(r, o, s));
    }
}

/// Σ v in f64 (a plain f32 sum over a long row drifts by ~√n ulps).
pub fn sum_f64(v: impl Iterator<Item = f32>) -> f64 {
    v.map(|x| x as f64).sum()
}

/// Runs `f` on the elements of a CPU tensor as f32: in place for a contiguous f32 tensor, on a
/// widened copy otherwise.
pub fn with_f32<R>(t: &crate::Tensor, f: impl FnOnce(&[f32]) -> R) -> crate::Result<R> {
    if t.dtype() == crate::DType::F32 && t.is_contiguous() {
        let n = t.numel();
        t.with_cpu::<f32, _>(|s| f(&s[..n]))
    } else {
        Ok(f(&t.to_f32_vec()?))
    }
}

/// Runs `f` on a CPU output tensor as f32: in place for a contiguous f32 tensor, else through a
/// buffer rounded into the tensor afterwards.
pub fn with_f32_out(t: &crate::Tensor, f: impl FnOnce(&mut [f32])) -> crate::Result<()> {
    if t.dtype() == crate::DType::F32 && t.is_contiguous() {
        let n = t.numel();
        t.with_cpu_mut::<f32, _>(|s| f(&mut s[..n]))
    } else {
        let mut buf = vec![0f32; t.numel()];
        f(&mut buf);
        t.write_f32(&buf)
    }
}
