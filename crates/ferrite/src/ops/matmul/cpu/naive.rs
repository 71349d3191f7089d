//! # Step 1 — `naive`: the triple loop
//!
//! For every output element (i, j), walk p over the shared dimension and accumulate
//! op(A)(i, p) · op(B)(p, j). This is the definition of the product and the baseline of the
//! ladder. It is slow for memory reasons, not arithmetic ones: with B row-major, the inner loop
//! walks *down a column* of B, touching a new cache line (16 floats) for every single
//! multiply-add, and nothing it loads is reused before it is evicted once n·k outgrows the cache.
//! Every element also goes through the bounds-checked transpose-aware accessors, which keeps the
//! loop scalar.

use super::Sgemm;

/// C = alpha · op(A) · op(B) + beta · C, one element at a time (loop order i, j, p).
pub fn naive(g: Sgemm) {
    g.debug_check();
    for i in 0..g.m {
        for j in 0..g.n {
            let mut acc = 0f32;
            for p in 0..g.k {
                acc += g.a_at(i, p) * g.b_at(p, j);
            }
            let c = &mut g.c[i * g.ldc + j];
            // beta == 0 must not read C: it may hold garbage or NaN (0 · NaN = NaN).
            *c = if g.beta == 0.0 {
                g.alpha * acc
            } else {
                g.alpha * acc + g.beta * *c
            };
        }
    }
}
