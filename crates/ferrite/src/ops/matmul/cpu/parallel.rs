//! # Step 4 — `parallel`: the `simd` kernel on every core
//!
//! `simd` already runs one core near its FMA peak, so the only way up is more cores. This step
//! keeps its packing, macro-kernel and micro-kernel unchanged and splits the work with rayon:
//!
//! - For each KC×NC block of op(B), the threads first pack it **together** (each packs a share
//!   of the NR panels) into one buffer that all of them then read: B is packed once, not once
//!   per thread, and the shared block sits in the L3 cache that the cores share.
//! - The m rows are then cut into about as many MC-sized blocks as there are threads (a
//!   multiple of the thread count, so the load is even); each thread packs **its own** A block
//!   into its private, L2-sized buffer and runs the macro-kernel on its own rows of C, so no
//!   two threads ever write the same element and no locking is needed.
//! - When m is too small to give every thread rows, the columns of the B block are split as
//!   well.
//!
//! Threads run in a dedicated rayon pool per thread count (built once, then cached), so the
//! requested count is honoured regardless of the global pool.

use super::simd::{kernel, macro_kernel, simd_with, with_bufs, Src};
use super::Sgemm;
use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `threads`, with 0 meaning every core.
pub(super) fn resolve_threads(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
}

/// The rayon pool with exactly `threads` workers, built on first use and kept for reuse.
pub(super) fn pool(threads: usize) -> Arc<ThreadPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    pools
        .entry(threads)
        .or_insert_with(|| {
            Arc::new(
                ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("ferrite-sgemm-{threads}-{i}"))
                    .build()
                    .expect("building the rayon thread pool"),
            )
        })
        .clone()
}

/// A pointer to C that may cross threads. Each task writes a disjoint window of C.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: the tasks that share a `CPtr` write pairwise-disjoint windows of C (distinct row blocks
// or distinct column ranges), and the `&mut` borrow of C outlives every task (they are joined
// before `parallel` returns).
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

impl CPtr {
    /// The element `off` floats in. (A method, so closures capture the whole `Send` wrapper
    /// rather than its raw-pointer field.)
    ///
    /// # Safety
    /// `off` must lie inside C.
    unsafe fn at(self, off: usize) -> *mut f32 {
        // SAFETY: the caller keeps `off` inside C.
        unsafe { self.0.add(off) }
    }
}

/// Below this many multiply-adds, threading costs more than it saves.
const MIN_PARALLEL_WORK: usize = 64 * 64 * 64;

/// C = alpha · op(A) · op(B) + beta · C on `threads` cores (0 = all).
pub fn parallel(mut g: Sgemm, threads: usize) {
    g.debug_check();
    let threads = resolve_threads(threads);
    let k = kernel();
    if threads == 1 || g.m * g.n * g.k < MIN_PARALLEL_WORK {
        return simd_with(k, g);
    }
    if g.m == 0 || g.n == 0 {
        return;
    }
    if g.k == 0 || g.alpha == 0.0 {
        g.scale_c();
        return;
    }
    let s = Src::of(&g);
    let (m, n, ldc, alpha) = (g.m, g.n, g.ldc, g.alpha);
    let c = CPtr(g.c.as_mut_ptr());

    // Row blocks: at least ceil(m/MC), rounded up to a multiple of the thread count, each a
    // whole number of MR panels.
    let m_panels = m.div_ceil(k.mr);
    let blocks = m.div_ceil(k.mc).next_multiple_of(threads).min(m_panels);
    let rows_per_block = m_panels.div_ceil(blocks) * k.mr;
    let blocks = m.div_ceil(rows_per_block);

    // The shared B block lives in the calling thread's buffer; the A blocks in each worker's.
    with_bufs(|_, bbuf| {
        pool(threads).install(|| {
            for jc in (0..n).step_by(k.nc) {
                let nc = k.nc.min(n - jc);
                let n_panels = nc.div_ceil(k.nr);
                // Column groups: split the panels of B too when there are fewer row blocks than
                // threads.
                let groups = threads.div_ceil(blocks).min(n_panels);
                let panels_per_group = n_panels.div_ceil(groups);
                let groups = n_panels.div_ceil(panels_per_group);
                for pc in (0..g.k).step_by(k.kc) {
                    let kc = k.kc.min(g.k - pc);
                    let panel = kc * k.nr;
                    let bp = bbuf.get(n_panels * panel);
                    // Pack the shared B block, a few panels per task.
                    let per_task = n_panels.div_ceil(threads * 4);
                    bp.par_chunks_mut(per_task * panel)
                        .enumerate()
                        .for_each(|(t, chunk)| {
                            let j = t * per_task * k.nr;
                            (k.pack_b)(&s, pc, kc, jc + j, (per_task * k.nr).min(nc - j), chunk);
                        });
                    let bp: &[f32] = bp;
                    let beta = if pc == 0 { g.beta } else { 1.0 };
                    (0..blocks * groups).into_par_iter().for_each(|task| {
                        let (ib, jg) = (task / groups, task % groups);
                        let ic = ib * rows_per_block;
                        let mc = rows_per_block.min(m - ic);
                        let j = jg * panels_per_group * k.nr;
                        let ncg = (panels_per_group * k.nr).min(nc - j);
                        let bsub = &bp[jg * panels_per_group * panel..];
                        with_bufs(|abuf, _| {
                            let ap = abuf.get(mc.div_ceil(k.mr) * kc * k.mr);
                            (k.pack_a)(&s, ic, mc, pc, kc, ap);
                            // SAFETY: `ap`/`bsub` are packed for (mc, ncg, kc) and 64-byte aligned
                            // (`bsub` starts a whole number of panels, each a multiple of 64 bytes,
                            // into the aligned buffer); the window at (ic, jc + j) of mc×ncg lies
                            // inside C and is written by this task only (distinct (ib, jg)); `k`
                            // came from `kernels()`.
                            unsafe {
                                let cw = c.at(ic * ldc + jc + j);
                                macro_kernel(k, mc, ncg, kc, ap, bsub, cw, ldc, alpha, beta);
                            }
                        });
                    });
                }
            }
        })
    });
}
