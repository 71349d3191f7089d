//! # The CPU f32 matrix-multiply ladder
//!
//! Each step keeps the previous one's arithmetic and changes one thing about how the data moves:
//!
//! 1. `naive` — the textbook triple loop. Correct, readable, and starved for memory bandwidth.
//! 2. `blocked` — cache tiles and the i-p-j loop order, so the inner loop streams contiguous
//!    rows that the compiler vectorises and the tiles are reused from L1/L2.
//! 3. `simd` — BLIS-style packing into contiguous panels plus a register-blocked micro-kernel
//!    written with explicit AVX-512 / AVX2+FMA intrinsics, picked at run time.
//! 4. `parallel` — the same packing and macro-kernel spread over cores with rayon.
//!
//! `peer` (feature `bench`) runs the `gemm` crate on the same arguments, the yardstick the
//! ladder is measured against.

mod blocked;
mod naive;
mod parallel;
mod simd;
#[cfg(test)]
mod tests;

pub use blocked::blocked;
pub use naive::naive;
pub use parallel::parallel;
pub use simd::{simd, simd_isa};

/// C = alpha · op(A) · op(B) + beta · C for one f32 matrix product, row-major with leading dims.
/// op(A) is m×k: element (i, p) is `a[i*lda + p]`, or `a[p*lda + i]` when `a_trans`.
/// op(B) is k×n: element (p, j) is `b[p*ldb + j]`, or `b[j*ldb + p]` when `b_trans`.
/// C is m×n: element (i, j) is `c[i*ldc + j]`. When beta == 0, C is not read (it may hold NaN).
pub struct Sgemm<'a> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub beta: f32,
    pub a: &'a [f32],
    pub lda: usize,
    pub a_trans: bool,
    pub b: &'a [f32],
    pub ldb: usize,
    pub b_trans: bool,
    pub c: &'a mut [f32],
    pub ldc: usize,
}

/// C = op(A)·op(B) on compact f32 operands (alpha 1, beta 0): the ladder's `parallel` kernel on
/// `threads` cores (0 = all) when `parallel`, else its `naive` triple loop. What other families'
/// CPU paths call (linear, moe).
#[allow(clippy::too_many_arguments)]
pub fn product(
    parallel: bool,
    threads: usize,
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    a_trans: bool,
    b: &[f32],
    ldb: usize,
    b_trans: bool,
    c: &mut [f32],
    ldc: usize,
) {
    let s = Sgemm {
        m,
        n,
        k,
        alpha: 1.0,
        beta: 0.0,
        a,
        lda: lda.max(1),
        a_trans,
        b,
        ldb: ldb.max(1),
        b_trans,
        c,
        ldc: ldc.max(1),
    };
    if parallel {
        self::parallel(s, threads)
    } else {
        naive(s)
    }
}

impl Sgemm<'_> {
    /// op(A)(i, p), bounds-checked. For the simple variants and packing edges.
    #[inline(always)]
    fn a_at(&self, i: usize, p: usize) -> f32 {
        if self.a_trans {
            self.a[p * self.lda + i]
        } else {
            self.a[i * self.lda + p]
        }
    }

    /// op(B)(p, j), bounds-checked.
    #[inline(always)]
    fn b_at(&self, p: usize, j: usize) -> f32 {
        if self.b_trans {
            self.b[j * self.ldb + p]
        } else {
            self.b[p * self.ldb + j]
        }
    }

    /// Checks (in debug builds) that every element the shape and leading dims address lies
    /// inside its slice. The public matmul layer has already validated this for release builds;
    /// the `unsafe` code in `simd`/`parallel` relies on it.
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let need = |rows: usize, cols: usize, ld: usize| {
                if rows == 0 || cols == 0 {
                    0
                } else {
                    (rows - 1) * ld + cols
                }
            };
            let (ar, ac) = if self.a_trans {
                (self.k, self.m)
            } else {
                (self.m, self.k)
            };
            let (br, bc) = if self.b_trans {
                (self.n, self.k)
            } else {
                (self.k, self.n)
            };
            debug_assert!(ar <= 1 || self.lda >= ac, "lda too small");
            debug_assert!(br <= 1 || self.ldb >= bc, "ldb too small");
            debug_assert!(self.m <= 1 || self.ldc >= self.n, "ldc too small");
            debug_assert!(self.a.len() >= need(ar, ac, self.lda), "a too short");
            debug_assert!(self.b.len() >= need(br, bc, self.ldb), "b too short");
            debug_assert!(
                self.c.len() >= need(self.m, self.n, self.ldc),
                "c too short"
            );
        }
    }

    /// C = beta·C over the m×n window (C = 0 when beta == 0, without reading C). The whole
    /// answer when k == 0 or alpha == 0.
    fn scale_c(&mut self) {
        for i in 0..self.m {
            let row = &mut self.c[i * self.ldc..i * self.ldc + self.n];
            if self.beta == 0.0 {
                row.fill(0.0);
            } else if self.beta != 1.0 {
                row.iter_mut().for_each(|x| *x *= self.beta);
            }
        }
    }
}

/// The same product through the `gemm` crate (the peer the ladder is measured against),
/// with `threads` workers (0 = all cores, 1 = no threading). Feature `bench`.
#[cfg(feature = "bench")]
pub fn peer(g: Sgemm, threads: usize) {
    g.debug_check();
    if g.m == 0 || g.n == 0 {
        return;
    }
    let threads = parallel::resolve_threads(threads);
    // op(A)(i, p) sits at i*rs + p*cs; op(B) likewise.
    let (a_rs, a_cs) = if g.a_trans { (1, g.lda) } else { (g.lda, 1) };
    let (b_rs, b_cs) = if g.b_trans { (1, g.ldb) } else { (g.ldb, 1) };
    let mut run = |par| {
        // SAFETY: the caller validated that every (i, p), (p, j) and (i, j) addressed through
        // these strides lies inside `a`, `b` and `c` (see `Sgemm`); `c` is borrowed mutably, so
        // nothing else aliases it. `read_dst = false` when beta == 0 makes gemm ignore C.
        // gemm computes dst := alpha·dst + beta·lhs·rhs, so our beta is its alpha and vice versa.
        unsafe {
            gemm::gemm(
                g.m,
                g.n,
                g.k,
                g.c.as_mut_ptr(),
                1,
                g.ldc as isize,
                g.beta != 0.0,
                g.a.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                g.b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                g.beta,
                g.alpha,
                false,
                false,
                false,
                par,
            )
        }
    };
    if threads == 1 {
        run(gemm::Parallelism::None);
    } else {
        // Run inside the same dedicated pool as `parallel`, so both use exactly `threads` workers.
        parallel::pool(threads).install(|| run(gemm::Parallelism::Rayon(threads)));
    }
}
