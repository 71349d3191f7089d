//! # Step 3 — `simd`: packed panels and a register-blocked micro-kernel (BLIS design)
//!
//! `blocked` keeps its accumulators in memory: every multiply-add loads and stores C. This step
//! keeps a whole MR×NR tile of C in vector *registers* for the entire k loop, so the inner loop
//! is nothing but broadcasts of A, loads of B and fused multiply-adds (FMAs). With MR×NR = 8×32
//! on AVX-512, each step of k does 16 FMAs (256 multiply-adds) for 2 vector loads of B and 8
//! scalar broadcasts of A: arithmetic, not memory, is now the limit.
//!
//! Feeding such a kernel takes three more ideas (Goto & van de Geijn; BLIS):
//!
//! - **Packing.** Before use, a KC×NC block of op(B) is copied into NR-column *panels* (for each
//!   p, NR consecutive floats) and an MC×KC block of op(A) into MR-row panels (for each p, MR
//!   consecutive floats). The micro-kernel then reads both with unit stride from 64-byte-aligned
//!   memory, whatever the original layout: packing is where the transposes, leading dimensions
//!   and ragged edges (zero padding) are dealt with, once, in O(m·k + k·n) work that the
//!   O(m·n·k) multiply amortises.
//! - **Blocking for the cache hierarchy.** The loops are ordered jc (NC) → pc (KC) → ic (MC) →
//!   jr (NR) → ir (MR). The packed B block (KC×NC) lives in L3, shared by all MC blocks of A;
//!   the packed A block (MC×KC) is swept past one B micro-panel (KC×NR) at a time from L2, the
//!   micro-panel being reused by every A micro-panel. The sizes are set per kernel, by
//!   measurement (see the kernel table below).
//! - **Run-time dispatch.** The micro-kernel is written with explicit intrinsics for AVX-512F and
//!   for AVX2+FMA, compiled with `#[target_feature]`, and picked once with
//!   `is_x86_feature_detected!`, so one binary runs the best kernel the CPU supports. A portable
//!   scalar kernel (which the compiler auto-vectorises for the baseline target) covers the rest.
//!
//! Edge tiles (m or n not a multiple of MR/NR) run the same full-size kernel into a small local
//! buffer and copy out only the valid part, so any m, n, k works with a single kernel per ISA.
//!
//! The pieces (`Kernel`, `pack_a`, `pack_b`, `macro_kernel`) are shared with `parallel`.

use super::Sgemm;
use std::cell::RefCell;
use std::sync::OnceLock;

/// The read-only operands, separated from C so threads can share them while writing C.
#[derive(Clone, Copy)]
pub(super) struct Src<'a> {
    pub a: &'a [f32],
    pub lda: usize,
    pub a_trans: bool,
    pub b: &'a [f32],
    pub ldb: usize,
    pub b_trans: bool,
}

impl<'a> Src<'a> {
    pub fn of(g: &Sgemm<'a>) -> Self {
        Src {
            a: g.a,
            lda: g.lda,
            a_trans: g.a_trans,
            b: g.b,
            ldb: g.ldb,
            b_trans: g.b_trans,
        }
    }
}

/// A micro-kernel: computes the MR×NR tile `acc = Σ_p a[p*MR + r] · b[p*NR + j]` over `kc`
/// steps of packed panels, then writes `c[r*ldc + j] = alpha·acc + beta·c[r*ldc + j]` for the
/// full MR×NR tile (C is not read when beta == 0).
///
/// Safety contract: `a` holds kc·MR and `b` kc·NR readable floats, `b` is 64-byte aligned, `c`
/// addresses a writable MR×NR tile with row stride `ldc`, and the CPU supports the kernel's ISA.
type MicroKernel = unsafe fn(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
);

/// A packing routine: `pack_a(src, i0, mc, p0, kc, dst)` or `pack_b(src, p0, kc, j0, nc, dst)`.
type PackFn = fn(&Src, usize, usize, usize, usize, &mut [f32]);

/// One micro-kernel and the blocking sizes that feed it.
pub(super) struct Kernel {
    pub name: &'static str,
    /// Rows of C per micro-tile (A values broadcast per k step).
    pub mr: usize,
    /// Columns of C per micro-tile (NR/16 or NR/8 vector registers per row).
    pub nr: usize,
    /// Depth of one packed block: how many k steps one micro-kernel call runs before C is
    /// loaded and stored. Larger amortises the C traffic and the kernel's entry/exit.
    pub kc: usize,
    /// Rows of a packed A block (multiple of MR); MC×KC floats are reread from L2/L3 per NR panel.
    pub mc: usize,
    /// Columns of a packed B block (multiple of NR): KC×NC floats should stay in L3.
    pub nc: usize,
    pub ukr: MicroKernel,
    pub pack_a: PackFn,
    pub pack_b: PackFn,
}

/// Largest tile any kernel uses, for the edge-tile scratch buffer.
const MAX_TILE: usize = 16 * 64;

/// 64 bytes of floats, so buffers built from it are cache-line (and zmm) aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A growable, 64-byte-aligned float buffer for packed panels.
#[derive(Default)]
pub(super) struct PackBuf(Vec<Line>);

impl PackBuf {
    /// The first `len` floats, growing the buffer if needed (contents unspecified).
    pub fn get(&mut self, len: usize) -> &mut [f32] {
        let lines = len.div_ceil(16);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0.0; 16]));
        }
        // SAFETY: `Line` is `repr(C)` over `[f32; 16]` with no padding, so the vector's storage
        // is `16 * self.0.len() >= len` initialised floats; the slice borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<f32>(), len) }
    }
}

thread_local! {
    /// Per-thread packing buffers (A block, B block), reused across calls to avoid allocating.
    static BUFS: RefCell<(PackBuf, PackBuf)> = RefCell::default();
}

/// Runs `f` with this thread's packing buffers (fresh ones if they are already in use).
pub(super) fn with_bufs<R>(f: impl FnOnce(&mut PackBuf, &mut PackBuf) -> R) -> R {
    BUFS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => {
            let (a, b) = &mut *bufs;
            f(a, b)
        }
        Err(_) => f(&mut PackBuf::default(), &mut PackBuf::default()),
    })
}

// ---------------------------------------------------------------------------------------------
// Packing
// ---------------------------------------------------------------------------------------------

/// Packs op(A)[i0..i0+mc, p0..p0+kc] into ceil(mc/MR) panels of kc·MR floats: panel q holds,
/// for each p, rows q·MR..q·MR+MR of column p, consecutively; rows past mc are zero.
fn pack_a<const MR: usize>(s: &Src, i0: usize, mc: usize, p0: usize, kc: usize, dst: &mut [f32]) {
    for (q, panel) in dst
        .chunks_exact_mut(kc * MR)
        .take(mc.div_ceil(MR))
        .enumerate()
    {
        let rows = MR.min(mc - q * MR);
        let i = i0 + q * MR;
        if s.a_trans {
            // op(A)(i, p) = a[p*lda + i]: each column of the panel is a contiguous run.
            for (p, out) in panel.chunks_exact_mut(MR).enumerate() {
                let col = &s.a[(p0 + p) * s.lda + i..][..rows];
                out[..rows].copy_from_slice(col);
                out[rows..].fill(0.0);
            }
        } else {
            // op(A)(i, p) = a[i*lda + p]: read each of the MR rows contiguously, write strided.
            for r in 0..MR {
                if r < rows {
                    let row = &s.a[(i + r) * s.lda + p0..][..kc];
                    for (p, &v) in row.iter().enumerate() {
                        panel[p * MR + r] = v;
                    }
                } else {
                    for p in 0..kc {
                        panel[p * MR + r] = 0.0;
                    }
                }
            }
        }
    }
}

/// Packs op(B)[p0..p0+kc, j0..j0+nc] into ceil(nc/NR) panels of kc·NR floats: panel q holds, for
/// each p, columns q·NR..q·NR+NR of row p, consecutively; columns past nc are zero.
fn pack_b<const NR: usize>(s: &Src, p0: usize, kc: usize, j0: usize, nc: usize, dst: &mut [f32]) {
    for (q, panel) in dst
        .chunks_exact_mut(kc * NR)
        .take(nc.div_ceil(NR))
        .enumerate()
    {
        let cols = NR.min(nc - q * NR);
        let j = j0 + q * NR;
        if s.b_trans {
            // op(B)(p, j) = b[j*ldb + p]: read each of the NR columns contiguously, write strided.
            for c in 0..NR {
                if c < cols {
                    let col = &s.b[(j + c) * s.ldb + p0..][..kc];
                    for (p, &v) in col.iter().enumerate() {
                        panel[p * NR + c] = v;
                    }
                } else {
                    for p in 0..kc {
                        panel[p * NR + c] = 0.0;
                    }
                }
            }
        } else {
            // op(B)(p, j) = b[p*ldb + j]: each row of the panel is a contiguous copy.
            for (p, out) in panel.chunks_exact_mut(NR).enumerate() {
                let row = &s.b[(p0 + p) * s.ldb + j..][..cols];
                out[..cols].copy_from_slice(row);
                out[cols..].fill(0.0);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels
// ---------------------------------------------------------------------------------------------

/// AVX-512F: an MR × (16·NV) tile held in MR·NV zmm registers.
///
/// The AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89,
/// so this needs a 1.89+ toolchain whatever the workspace's declared `rust-version` says.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
#[target_feature(enable = "avx512f")]
unsafe fn ukr_avx512<const MR: usize, const NV: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    use std::arch::x86_64::*;
    // Start pulling the C tile into L1 now; the k loop below hides the latency.
    for r in 0..MR {
        for v in 0..NV {
            // SAFETY: a prefetch never faults; the addresses are inside the C tile anyway.
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16 * v).cast::<i8>());
        }
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        // SAFETY (whole loop): per the `MicroKernel` contract, `a` and `b` hold kc·MR and
        // kc·16·NV floats, and `b` stays 64-byte aligned since 16·NV floats is a multiple of 64
        // bytes, so every load below is in bounds and aligned.
        let mut bv = [_mm512_setzero_ps(); NV];
        for (v, bv) in bv.iter_mut().enumerate() {
            *bv = _mm512_load_ps(b.add(16 * v));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = _mm512_set1_ps(*a.add(r));
            for v in 0..NV {
                acc[v] = _mm512_fmadd_ps(ar, bv[v], acc[v]);
            }
        }
        a = a.add(MR);
        b = b.add(16 * NV);
    }
    let va = _mm512_set1_ps(alpha);
    let vb = _mm512_set1_ps(beta);
    for (r, acc) in acc.iter().enumerate() {
        for (v, &x) in acc.iter().enumerate() {
            // SAFETY: `c` addresses a writable MR×(16·NV) tile with row stride ldc (contract).
            let p = c.add(r * ldc + 16 * v);
            let out = if beta == 0.0 {
                _mm512_mul_ps(va, x)
            } else {
                _mm512_fmadd_ps(vb, _mm512_loadu_ps(p), _mm512_mul_ps(va, x))
            };
            _mm512_storeu_ps(p, out);
        }
    }
}

/// AVX2+FMA: an MR × (8·NV) tile held in MR·NV ymm registers (6×16 uses 12 of the 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn ukr_avx2<const MR: usize, const NV: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); NV]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        // SAFETY (whole loop): as in `ukr_avx512`; 8·NV floats keeps `b` 32-byte aligned.
        let mut bv = [_mm256_setzero_ps(); NV];
        for (v, bv) in bv.iter_mut().enumerate() {
            *bv = _mm256_load_ps(b.add(8 * v));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = _mm256_broadcast_ss(&*a.add(r));
            for v in 0..NV {
                acc[v] = _mm256_fmadd_ps(ar, bv[v], acc[v]);
            }
        }
        a = a.add(MR);
        b = b.add(8 * NV);
    }
    let va = _mm256_set1_ps(alpha);
    let vb = _mm256_set1_ps(beta);
    for (r, acc) in acc.iter().enumerate() {
        for (v, &x) in acc.iter().enumerate() {
            // SAFETY: `c` addresses a writable MR×(8·NV) tile with row stride ldc (contract).
            let p = c.add(r * ldc + 8 * v);
            let out = if beta == 0.0 {
                _mm256_mul_ps(va, x)
            } else {
                _mm256_fmadd_ps(vb, _mm256_loadu_ps(p), _mm256_mul_ps(va, x))
            };
            _mm256_storeu_ps(p, out);
        }
    }
}

/// Portable: plain arrays the compiler can keep in registers and vectorise for any target.
unsafe fn ukr_portable<const MR: usize, const NR: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    // SAFETY: per the `MicroKernel` contract `a`/`b` hold kc·MR / kc·NR floats and `c` addresses
    // a writable MR×NR tile with row stride ldc.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(a, kc * MR),
            std::slice::from_raw_parts(b, kc * NR),
        )
    };
    let mut acc = [[0f32; NR]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        for r in 0..MR {
            for j in 0..NR {
                acc[r][j] += ap[r] * bp[j];
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r of the tile is NR writable floats at c + r·ldc (contract).
        let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) };
        for (cv, &x) in row.iter_mut().zip(acc) {
            *cv = if beta == 0.0 {
                alpha * x
            } else {
                alpha * x + beta * *cv
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel selection
// ---------------------------------------------------------------------------------------------

/// Builds a `Kernel` for const tile sizes, keeping `ukr`, `pack_a` and `pack_b` consistent.
macro_rules! kernel {
    ($name:expr, $mr:expr, $nr:expr, $ukr:expr, kc = $kc:expr, mc = $mc:expr, nc = $nc:expr) => {
        Kernel {
            name: $name,
            mr: $mr,
            nr: $nr,
            kc: $kc,
            mc: $mc,
            nc: $nc,
            ukr: $ukr,
            pack_a: pack_a::<$mr>,
            pack_b: pack_b::<$nr>,
        }
    };
}

// Tile shapes and blocking, chosen by measurement on an AMD EPYC (Zen 4: 32 KiB L1d, 1 MiB L2
// per core, 32 MiB L3; AVX-512 runs as two 256-bit halves, so zmm and ymm FMAs peak alike).
//
// - AVX-512 8×32: 16 zmm accumulators (the FMA latency × throughput needs ≥ 8) + 2 for B + 1
//   broadcast. 14×32, 12×32, 6×64 measured the same within noise (±3 %); 8×32 divides the
//   usual power-of-two sizes, so no work is wasted on padded edge tiles.
// - KC = 1024: one 8×32 call is 1024·16 = 16 K FMAs per 32 zmm loads/stores of C. Going from
//   KC = 256 to 512 to 1024 gained ~4 % each step at 1024³–2048³: the B micro-panel (128 KiB)
//   then streams from L2 instead of sitting in L1, but the kernel needs only ~10 bytes/cycle
//   of it, far below what L2 delivers.
// - MC = 256 (A block 1 MiB), NC = 2048 (B block 8 MiB, a quarter of L3).
// - AVX2 6×16: 12 ymm accumulators + 2 + 1 of the 16 registers, the classic Haswell shape.
#[cfg(target_arch = "x86_64")]
static AVX512: Kernel = kernel!(
    "avx512f",
    8,
    32,
    ukr_avx512::<8, 2>,
    kc = 1024,
    mc = 256,
    nc = 2048
);
#[cfg(target_arch = "x86_64")]
static AVX2: Kernel = kernel!(
    "avx2+fma",
    6,
    16,
    ukr_avx2::<6, 2>,
    kc = 1024,
    mc = 240,
    nc = 2048
);
static PORTABLE: Kernel = kernel!(
    "portable",
    4,
    16,
    ukr_portable::<4, 16>,
    kc = 256,
    mc = 128,
    nc = 2048
);

/// Every kernel this CPU can run, best first.
pub(super) fn kernels() -> Vec<&'static Kernel> {
    #[allow(unused_mut)]
    let mut v: Vec<&'static Kernel> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            v.push(&AVX512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            v.push(&AVX2);
        }
    }
    v.push(&PORTABLE);
    v
}

/// The kernel `simd` and `parallel` use: the best this CPU supports, chosen once.
pub(super) fn kernel() -> &'static Kernel {
    static K: OnceLock<&'static Kernel> = OnceLock::new();
    K.get_or_init(|| kernels()[0])
}

/// The micro-kernel chosen at run time: "avx512f", "avx2+fma" or "portable".
pub fn simd_isa() -> &'static str {
    kernel().name
}

// ---------------------------------------------------------------------------------------------
// Macro-kernel and driver
// ---------------------------------------------------------------------------------------------

/// Multiplies a packed A block (mc×kc, MR-row panels) by a packed B block (kc×nc, NR-column
/// panels) into the mc×nc window of C at `c` (row stride ldc): C = alpha·A·B + beta·C.
///
/// # Safety
/// `ap` holds ceil(mc/MR)·kc·MR packed floats and `bp` ceil(nc/NR)·kc·NR, 64-byte aligned;
/// `c` addresses a writable mc×nc window with row stride `ldc` that no other thread touches
/// during the call; the CPU supports `k`'s ISA (guaranteed when `k` came from `kernels()`).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn macro_kernel(
    k: &Kernel,
    mc: usize,
    nc: usize,
    kc: usize,
    ap: &[f32],
    bp: &[f32],
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    let (mr, nr) = (k.mr, k.nr);
    debug_assert!(mr * nr <= MAX_TILE);
    debug_assert!(ap.len() >= mc.div_ceil(mr) * kc * mr && bp.len() >= nc.div_ceil(nr) * kc * nr);
    let mut tmp = [Line([0.0; 16]); MAX_TILE / 16];
    let tmp = tmp.as_mut_ptr().cast::<f32>();
    // jr outside, ir inside: one KC×NR panel of B stays in L1 while all of A's panels pass by.
    for (jq, bpanel) in bp.chunks_exact(kc * nr).take(nc.div_ceil(nr)).enumerate() {
        let j = jq * nr;
        let cols = nr.min(nc - j);
        for (iq, apanel) in ap.chunks_exact(kc * mr).take(mc.div_ceil(mr)).enumerate() {
            let i = iq * mr;
            let rows = mr.min(mc - i);
            // SAFETY: the panels hold kc·MR and kc·NR floats (chunks_exact), `bpanel` starts at
            // a multiple of kc·NR·4 bytes (a multiple of 64) from the aligned `bp`; (i, j) lies
            // inside the mc×nc window. `k` matches the CPU (caller's contract).
            unsafe {
                let cij = c.add(i * ldc + j);
                if rows == mr && cols == nr {
                    (k.ukr)(kc, apanel.as_ptr(), bpanel.as_ptr(), cij, ldc, alpha, beta);
                } else {
                    // Edge tile: full-size kernel into `tmp` (row stride NR, beta = 0 so `tmp` is
                    // not read), then merge only the rows × cols that exist.
                    (k.ukr)(kc, apanel.as_ptr(), bpanel.as_ptr(), tmp, nr, alpha, 0.0);
                    for r in 0..rows {
                        for jj in 0..cols {
                            let t = *tmp.add(r * nr + jj);
                            let cp = cij.add(r * ldc + jj);
                            *cp = if beta == 0.0 { t } else { t + beta * *cp };
                        }
                    }
                }
            }
        }
    }
}

/// C = alpha · op(A) · op(B) + beta · C, single-threaded, with the best micro-kernel.
pub fn simd(g: Sgemm) {
    simd_with(kernel(), g)
}

/// `simd` with a given kernel (the tests run every kernel the CPU supports).
pub(super) fn simd_with(k: &Kernel, mut g: Sgemm) {
    g.debug_check();
    if g.m == 0 || g.n == 0 {
        return;
    }
    if g.k == 0 || g.alpha == 0.0 {
        g.scale_c();
        return;
    }
    let s = Src::of(&g);
    let c = g.c.as_mut_ptr();
    with_bufs(|abuf, bbuf| {
        for jc in (0..g.n).step_by(k.nc) {
            let nc = k.nc.min(g.n - jc);
            for pc in (0..g.k).step_by(k.kc) {
                let kc = k.kc.min(g.k - pc);
                let bp = bbuf.get(nc.div_ceil(k.nr) * kc * k.nr);
                (k.pack_b)(&s, pc, kc, jc, nc, bp);
                // The first KC slice applies the caller's beta; later ones accumulate.
                let beta = if pc == 0 { g.beta } else { 1.0 };
                for ic in (0..g.m).step_by(k.mc) {
                    let mc = k.mc.min(g.m - ic);
                    let ap = abuf.get(mc.div_ceil(k.mr) * kc * k.mr);
                    (k.pack_a)(&s, ic, mc, pc, kc, ap);
                    // SAFETY: the buffers were packed for exactly (mc, nc, kc) and are aligned;
                    // the window (ic, jc) + mc×nc lies in C (validated shape), which `g` borrows
                    // mutably; `k` came from `kernels()`.
                    unsafe {
                        macro_kernel(
                            k,
                            mc,
                            nc,
                            kc,
                            ap,
                            bp,
                            c.add(ic * g.ldc + jc),
                            g.ldc,
                            g.alpha,
                            beta,
                        )
                    };
                }
            }
        }
    })
}
