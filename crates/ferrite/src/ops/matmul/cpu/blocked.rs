//! # Step 2 — `blocked`: cache tiles and the i-p-j loop order
//!
//! Two changes over `naive`, same arithmetic:
//!
//! - **Loop order i-p-j.** Instead of one dot product per C element, each row of C is updated
//!   with `c[i, :] += a(i, p) · b[p, :]` for every p. The inner loop now streams a *row* of B and
//!   a row of C, both contiguous, with one scalar of A held in a register: no cache line is
//!   wasted, and the compiler turns the loop into SIMD multiply-adds (an "axpy").
//! - **Tiling.** The loops over p and j are cut into KC×NC tiles of B (256×512 floats = 512 KiB,
//!   sized to stay in the 1 MiB L2). All m rows of C sweep over one tile before the next is
//!   touched, so each B element is fetched from memory once per tile rather than once per row
//!   of C, and the slice of a C row being updated (NC floats = 2 KiB) stays in L1 across the
//!   KC passes over it.
//!
//! When B is transposed its rows are not contiguous, so each tile is first copied into a
//! row-major scratch buffer; the copy costs O(KC·NC) and is reused by all m rows. (The next step,
//! `simd`, generalises this copy into "packing".)
//!
//! What still limits it: every multiply-add loads and stores C (the accumulator lives in memory,
//! not in registers), so it runs at load/store speed, a fraction of the FMA units' peak.

use super::Sgemm;

/// Rows of op(B) per tile (the p extent).
const KC: usize = 256;
/// Columns of op(B) and C per tile (the j extent).
const NC: usize = 512;

/// C = alpha · op(A) · op(B) + beta · C with cache tiles and contiguous inner loops.
pub fn blocked(mut g: Sgemm) {
    g.debug_check();
    // C = beta·C first; the tiles below then only accumulate alpha·op(A)·op(B) into it.
    g.scale_c();
    if g.k == 0 || g.alpha == 0.0 {
        return;
    }
    // Copy the A fields out so reading A does not borrow `g` while a row of C is borrowed.
    let (a, lda, a_trans, alpha) = (g.a, g.lda, g.a_trans, g.alpha);
    let a_at = |i: usize, p: usize| {
        if a_trans {
            a[p * lda + i]
        } else {
            a[i * lda + p]
        }
    };
    let mut tile = if g.b_trans {
        vec![0f32; KC * NC]
    } else {
        Vec::new()
    };
    for jc in (0..g.n).step_by(NC) {
        let nc = NC.min(g.n - jc);
        for pc in (0..g.k).step_by(KC) {
            let kc = KC.min(g.k - pc);
            // (slice, row stride, offset of op(B)(pc, jc)) of the tile being multiplied.
            let (bt, ldt, off): (&[f32], usize, usize) = if g.b_trans {
                for p in 0..kc {
                    for j in 0..nc {
                        tile[p * nc + j] = g.b[(jc + j) * g.ldb + pc + p];
                    }
                }
                (&tile, nc, 0)
            } else {
                (g.b, g.ldb, pc * g.ldb + jc)
            };
            for i in 0..g.m {
                let crow = &mut g.c[i * g.ldc + jc..i * g.ldc + jc + nc];
                for p in 0..kc {
                    let a = alpha * a_at(i, pc + p);
                    let brow = &bt[off + p * ldt..off + p * ldt + nc];
                    // The contiguous axpy the compiler vectorises.
                    for (c, &b) in crow.iter_mut().zip(brow) {
                        *c += a * b;
                    }
                }
            }
        }
    }
}
