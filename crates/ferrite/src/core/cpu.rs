//! CPU helpers shared by the row-wise op families.

use rayon::prelude::*;

/// Below this many output elements the parallel rungs run on the calling thread: waking the
/// thread pool costs tens of µs, more than the whole op on a small tensor.
pub const PAR_MIN_ELEMS: usize = 1 << 15;

/// Σ `a[p]·b[p]` with 8 independent partial sums (vectorisable; a fixed order, so serial and
/// parallel runs give the same bits). The GEMV-shaped CPU rungs' inner product (w8a16,
/// scaled_mm).
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Runs `f(row, out_row, slot)` for every row of `out` (rows of `cols` elements), serially or
/// split across cores (when `parallel` and `out` holds at least [`PAR_MIN_ELEMS`]); each row gets
/// its own slot of `per_row`. Every row is computed by the same code either way, so serial and
/// parallel results are identical.
pub fn for_rows<S: Send, F>(parallel: bool, cols: usize, out: &mut [f32], per_row: &mut [S], f: F)
where
    F: Fn(usize, &mut [f32], &mut S) + Sync + Send,
{
    let cols = cols.max(1);
    if parallel && out.len() >= PAR_MIN_ELEMS {
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
        if t.is_contiguous() || t.numel() == 0 {
            return t.write_f32(&buf);
        }
        // A view whose rows are contiguous but apart (a [N, V] view of a wider buffer): row by row.
        let r = t.rank();
        if r < 1 || t.strides()[r - 1] != 1 {
            return Err(crate::Error::bad_arg(
                "with_f32_out",
                "t",
                "a tensor whose last dim is contiguous",
                crate::core::tensor::describe(t),
            ));
        }
        let cols = t.shape()[r - 1];
        let flat = t.reshape(&[t.numel() / cols.max(1), cols]).ok();
        let rows = match flat {
            Some(f) => f,
            None if r == 2 => t.clone(),
            None => {
                return Err(crate::Error::bad_arg(
                    "with_f32_out",
                    "t",
                    "a 2-D row-strided or contiguous tensor",
                    crate::core::tensor::describe(t),
                ))
            }
        };
        for (i, chunk) in buf.chunks(cols.max(1)).enumerate() {
            rows.narrow(0, i, 1)?.write_f32(chunk)?;
        }
        Ok(())
    }
}

/// e^x of every element, in place, vectorised: the CPU rungs' replacement for libm's scalar
/// `expf` (one call per element, ~20 cycles) in the exp-heavy row ops.
///
/// Method (Cody–Waite): n = round(x·log₂e), r = x − n·ln2 split in two constants so r is exact to
/// a few ulps, e^r by a degree-7 polynomial on |r| ≤ ln2/2 (Cephes' coefficients), times 2ⁿ built
/// in the exponent bits. Branch-free, so LLVM vectorises the loop: 16 lanes with AVX-512, 8 with
/// AVX2+FMA (both compiled in and picked at run time), 4 with the baseline SSE2.
/// Accuracy: ≤ 2 ulp for −87.3 ≤ x ≤ 88.7 (tested against f64); below −87.3 the result is 0
/// (true values there are subnormal, < 1.2e−38); above 88.72, +inf; NaN stays NaN.
pub fn exp_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { exp_avx512(v) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { exp_avx2(v) };
        }
    }
    exp_loop(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(v: &mut [f32]) {
    exp_loop(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(v: &mut [f32]) {
    exp_loop(v)
}

#[inline(always)]
fn exp_loop(v: &mut [f32]) {
    for x in v.iter_mut() {
        *x = exp_one(*x);
    }
}

/// One lane of [`exp_in_place`] (selects only, so the loop around it vectorises).
#[inline(always)]
pub fn exp_one(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with few mantissa bits so n·C1 is exact for |n| ≤ 128.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Adding 1.5·2²³ rounds a float of magnitude < 2²² to an integer (round to nearest even).
    const ROUND: f32 = 12_582_912.0;
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.722_83;
    let xc = x.clamp(LO, HI);
    let n = ((xc * LOG2E + ROUND) - ROUND).min(127.0);
    let r = xc - n * C1 - n * C2;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * (r * r)
        + r
        + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let e = p * scale;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        e
    }
}

/// max(v) (−inf for an empty slice), vectorised: 16 independent lanes compared with `>` (a plain
/// `f32::max` fold is a serial chain LLVM will not reorder). NaN elements are skipped, as `max`
/// skips them; callers that must propagate NaN see it through their own arithmetic.
pub fn max_lanes(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    acc.iter().fold(tail, |m, &x| if x > m { x } else { m })
}

/// Σ f(v), vectorised: 16 f32 lanes over blocks of 1024 elements (each lane adds 64 values:
/// error ≲ 64 ulps of a partial, ~4e−6 relative), the blocks' partials summed in f64. `f` is
/// inlined into the lane loop (a plain closure keeps it vectorisable).
#[inline(always)]
fn sum_lanes_of(v: &[f32], f: impl Fn(f32) -> f32 + Copy) -> f64 {
    v.chunks(1024)
        .map(|b| {
            let mut acc = [0f32; 16];
            let mut chunks = b.chunks_exact(16);
            for c in &mut chunks {
                for (a, &x) in acc.iter_mut().zip(c) {
                    *a += f(x);
                }
            }
            let tail: f64 = chunks.remainder().iter().map(|&x| f(x) as f64).sum();
            acc.iter().map(|&x| x as f64).sum::<f64>() + tail
        })
        .sum()
}

/// Σ v, vectorised: 16 f32 lanes over blocks of 1024 elements (each lane adds 64 values: error
/// ≲ 64 ulps of a partial, ~4e−6 relative), the blocks' partials summed in f64.
pub fn sum_lanes(v: &[f32]) -> f64 {
    sum_lanes_of(v, |x| x)
}

/// Σ (v − c)², vectorised as `sum_lanes`: a row's variance about its mean without a serial f64
/// chain.
pub fn sum_sq_dev_lanes(v: &[f32], c: f32) -> f64 {
    sum_lanes_of(v, |x| (x - c) * (x - c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_max_and_sum_match_serial() {
        let mut rng = crate::core::rng::Rng::new(5);
        for n in [0usize, 1, 15, 16, 17, 1000, 1024, 1025, 5003] {
            let v: Vec<f32> = (0..n).map(|_| rng.uniform(-50.0, 50.0) as f32).collect();
            let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_lanes(&v), m, "n = {n}");
            let s: f64 = v.iter().map(|&x| x as f64).sum();
            let mag: f64 = v.iter().map(|&x| x.abs() as f64).sum();
            assert!((sum_lanes(&v) - s).abs() <= 1e-5 * mag.max(1.0), "n = {n}");
            let c = 3.25f32;
            let sq: f64 = v.iter().map(|&x| (x as f64 - c as f64).powi(2)).sum();
            assert!(
                (sum_sq_dev_lanes(&v, c) - sq).abs() <= 1e-5 * sq.max(1.0),
                "n = {n}"
            );
        }
        assert_eq!(max_lanes(&[1.0, f32::NAN, 3.0]), 3.0);
    }

    #[test]
    fn exp_matches_f64_within_2_ulp_and_handles_the_edges() {
        let mut rng = crate::core::rng::Rng::new(11);
        let mut xs: Vec<f32> = (0..20_000)
            .map(|_| rng.uniform(-87.3, 88.7) as f32)
            .collect();
        xs.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            1.0,
            -1.0,
            0.5 * std::f32::consts::LN_2,
            -87.3,
            88.7,
        ]);
        xs.extend((0..2000).map(|i| -20.0 + i as f32 * 0.02)); // dense where softmax lives
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (&x, &g) in xs.iter().zip(&got) {
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                ((g as f64) - want).abs() <= 2.0 * ulp as f64,
                "exp({x}) = {g}, want {want}"
            );
        }
        let mut edges = [f32::NEG_INFINITY, -100.0, f32::INFINITY, 100.0, f32::NAN];
        exp_in_place(&mut edges);
        assert_eq!(edges[..4], [0.0, 0.0, f32::INFINITY, f32::INFINITY]);
        assert!(edges[4].is_nan());
        // The portable loop (SSE2 lanes) gives the same bits as the dispatched one.
        let mut a: Vec<f32> = xs.iter().take(999).copied().collect();
        let b: Vec<f32> = a.iter().map(|&x| exp_one(x)).collect();
        exp_in_place(&mut a);
        assert_eq!(a, b);
    }
}
