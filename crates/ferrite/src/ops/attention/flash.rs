//! Host code of the `flash` rung (kernels/flash.cu): FlashAttention-2-style forward and two
//! backwards on mma.sync tensor cores (sm_80+): the default one pass with dQ through f32 atomics
//! (`BwdMode::Atomic`), and a deterministic one without atomics that recomputes S and dP a second
//! time for dQ (`BwdMode::Deterministic`, chosen by `AttentionOptions::deterministic`).

use super::{Problem, Varlen, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{CudaDevice, DeviceBuffer, Kernel, KernelArgs, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("attention/flash", "kernels/flash.cu");
const FUNCS: [&str; 6] = [
    "flash_fwd",
    "flash_bwd_dot",
    "flash_bwd_dkdv",
    "flash_bwd_dq",
    "flash_bwd_fused",
    "flash_bwd_dq_convert",
];

/// Head dims the kernels are specialised for.
pub const HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];

// Tile geometry, as in flash.cu.
const KV_BN: usize = 64;
const KV_BM: usize = 32;
const Q_BM: usize = 64;
const Q_BN: usize = 32;
const B_THREADS: u32 = 128;

/// Element strides (batch, seq, head), as `Strides` in flash.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Strides {
    b: i64,
    s: i64,
    h: i64,
}

impl From<[i64; 3]> for Strides {
    fn from(s: [i64; 3]) -> Self {
        Strides {
            b: s[0],
            s: s[1],
            h: s[2],
        }
    }
}

/// Scale and soft-cap folded into the log2 domain, as `ScoreMap` in flash.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScoreMap {
    scale_log2: f32,
    cap_in: f32,
    cap_out_log2: f32,
    capped: i32,
}

fn score_map(p: &Problem) -> ScoreMap {
    let log2e = std::f32::consts::LOG2_E;
    let capped = p.softcap > 0.0;
    ScoreMap {
        scale_log2: p.scale * log2e,
        cap_in: if capped { p.scale / p.softcap } else { 0.0 },
        cap_out_log2: if capped { p.softcap * log2e } else { 0.0 },
        capped: capped as i32,
    }
}

pub fn program(
    dtype: DType,
    head_dim: usize,
    softcap: bool,
    fwd_mt: usize,
    bwd: BwdGeom,
) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_HEAD_DIM", head_dim)
        .define("FE_SOFTCAP", softcap as u32)
        .define("FE_FWD_MT", fwd_mt)
        .define("FE_BWD_WARPS", bwd.warps)
        .define("FE_BWD_BM", bwd.bm)
        .define("FE_BWD_QM", bwd.qm)
}

/// Geometry of the one-pass (atomic dQ) backward, `FE_BWD_*` in flash.cu: `warps` × 16 keys per
/// block, `bm` queries per step, `qm` m16 tiles per warp in the dQ product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdGeom {
    pub warps: usize,
    pub bm: usize,
    pub qm: usize,
}

impl BwdGeom {
    /// The geometry `backward` uses at a head dim.
    pub fn default_for(head_dim: usize) -> BwdGeom {
        if head_dim <= 64 {
            // 64-query steps: the K/V fragments of Sᵀ and dPᵀ feed 8 mma instead of 4, and the
            // per-step barriers and copies are amortised over twice the FLOPs. Registers allow it
            // here (dK/dV 64 + Sᵀ/dPᵀ 64 accumulators at D64), not at D96/D128. dQ warp tile
            // 32×32 at D64 (32×16 at D32).
            BwdGeom {
                warps: 4,
                bm: 64,
                qm: 2,
            }
        } else {
            // 32-query steps; dQ warp tile 32×32 at D128 (4 ldmatrix per 8 mma), 16×48 at D96.
            BwdGeom {
                warps: 4,
                bm: 32,
                qm: if head_dim == 128 { 2 } else { 1 },
            }
        }
    }

    /// The default first, then the alternatives worth timing against it (the GPU smoke test
    /// runs them all; `flash_speed` times them; `kernel_specs` lists them for ptxas).
    pub fn candidates(head_dim: usize) -> Vec<BwdGeom> {
        let g = |warps, bm, qm| BwdGeom { warps, bm, qm };
        // (4, 32, ·): 32-query steps, the first geometry. (4, 64, 2) at D128: 64-query steps
        // with 255 registers (fewer ldmatrix per mma, half the barriers per FLOP, but ptxas has
        // no room left to overlap; at D96 it spills). (8, ·, ·): 8 warps × 16 keys per block,
        // half the dQ reductions and Q/dO copies per FLOP, narrower dQ warp tiles, one block
        // per SM.
        let alts: &[BwdGeom] = match head_dim {
            32 => &[g(4, 32, 1)],
            64 => &[g(4, 32, 1), g(8, 64, 2)],
            128 => &[g(4, 64, 2), g(8, 64, 2), g(8, 32, 1), g(4, 32, 1)],
            _ => &[],
        };
        let mut v = vec![BwdGeom::default_for(head_dim)];
        v.extend(alts.iter().copied().filter(|g| g.fits(head_dim)));
        v
    }

    /// Keys per block.
    pub fn keys(&self) -> usize {
        16 * self.warps
    }

    /// Whether the warps tile the [bm × head_dim] dQ product (the static_assert in flash.cu).
    pub fn fits(&self, head_dim: usize) -> bool {
        let (w, bm, qm) = (self.warps, self.bm, self.qm);
        if w == 0 || qm == 0 || !bm.is_multiple_of(32) || !bm.is_multiple_of(16 * qm) {
            return false;
        }
        let wgm = bm / (16 * qm);
        if wgm == 0 || !w.is_multiple_of(wgm) {
            return false;
        }
        let wgn = w / wgm;
        (head_dim / 16).is_multiple_of(wgn) && head_dim / 16 / wgn >= 1
    }

    /// Dynamic shared memory: K, V, a 2-slot ring of Q and dO, dSᵀ, and lse/Δ per slot.
    fn smem(&self, head_dim: usize, dtype: DType) -> u32 {
        let (lds, es) = (head_dim + 8, dtype.size_in_bytes());
        let (bn, bm) = (self.keys(), self.bm);
        ((2 * bn + 4 * bm) * lds * es + bn * (bm + 8) * es + 4 * bm * 4) as u32
    }

    fn describe(&self) -> String {
        format!("{} warps × 16 keys, {}-query steps", self.warps, self.bm)
    }
}

/// Which backward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdMode {
    /// Three kernels (Δ, dK/dV, dQ), each output summed by one owner in a fixed order: the same
    /// bits every run; S, P and dP are computed twice (7 GEMMs of work for 5).
    Deterministic,
    /// Δ, then one pass over the keys that also adds dS·K into an f32 dQ accumulator with
    /// atomics, then a conversion: 5 GEMMs; dQ's low bits vary with the order of the additions.
    Atomic(BwdGeom),
}

impl BwdMode {
    pub fn of(deterministic: bool, head_dim: usize) -> BwdMode {
        if deterministic {
            BwdMode::Deterministic
        } else {
            BwdMode::Atomic(BwdGeom::default_for(head_dim))
        }
    }

    pub fn describe(&self) -> String {
        match self {
            BwdMode::Deterministic => "deterministic: dK/dV and dQ kernels, no atomics".into(),
            BwdMode::Atomic(g) => format!("one pass, atomic f32 dQ; {}", g.describe()),
        }
    }
}

/// m16 row tiles per warp in the forward (FE_FWD_MT): 2 halves the shared-memory traffic per
/// FLOP; 1 is the earlier 8-warp shape.
pub fn default_fwd_mt(head_dim: usize) -> usize {
    let _ = head_dim;
    2
}

/// Forward tile: (query rows, keys, threads) for FE_FWD_MT; 64-key tiles (the kernel's
/// FE_FWD_BN) at every head dim. The kernel traps if given less shared memory than this implies.
fn fwd_tile(mt: usize) -> (usize, usize, u32) {
    (128, 64, (128 / (16 * mt) * 32) as u32)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::BF16, DType::F16] {
        for hd in HEAD_DIMS {
            v.push(KernelSpec {
                program: program(d, hd, false, default_fwd_mt(hd), BwdGeom::default_for(hd)),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
            // The backward's alternative geometries, and soft-capping at D128 (the kernels
            // shortest of registers); bf16 only: f16 compiles alike.
            if d == DType::BF16 {
                for g in BwdGeom::candidates(hd).into_iter().skip(1) {
                    v.push(KernelSpec {
                        program: program(d, hd, false, default_fwd_mt(hd), g),
                        functions: vec!["flash_bwd_fused".into()],
                        min_arch: Arch::SM80,
                    });
                }
                if hd == 128 {
                    v.push(KernelSpec {
                        program: program(d, hd, true, default_fwd_mt(hd), BwdGeom::default_for(hd)),
                        functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                        min_arch: Arch::SM80,
                    });
                }
            }
        }
    }
    v
}

fn smem_bytes(head_dim: usize, dtype: DType, fwd_mt: usize) -> [u32; 3] {
    let lds = head_dim + 8;
    let es = dtype.size_in_bytes();
    let (bm, bn, _) = fwd_tile(fwd_mt);
    [
        ((bm + 4 * bn) * lds * es) as u32,
        ((2 * KV_BN + 4 * KV_BM) * lds * es + 4 * KV_BM * 4) as u32,
        ((2 * Q_BM + 4 * Q_BN) * lds * es) as u32,
    ]
}

/// Why `flash` cannot run this problem (None when it can). `ptrs` are the base addresses of
/// every q/k/v/o-like tensor of the call.
pub fn unfit(p: &Problem, ptrs: &[u64]) -> Option<String> {
    if !matches!(p.dtype, DType::BF16 | DType::F16) {
        return Some(format!("needs bf16 or f16 (got {})", p.dtype));
    }
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Some(format!(
            "needs head dim in {HEAD_DIMS:?} (got {})",
            p.head_dim
        ));
    }
    // Positions and in-sequence indices are 32-bit in the kernels (with room for a tile).
    if p.seqlen_q.max(p.seqlen_k) > i32::MAX as usize - 256 {
        return Some(format!(
            "needs sequence lengths below 2³¹ − 256 (got {} and {})",
            p.seqlen_q, p.seqlen_k
        ));
    }
    let strides = [p.q_stride, p.k_stride, p.v_stride, p.o_stride];
    if strides.iter().flatten().any(|s| s % 8 != 0) {
        return Some(
            "needs batch/seq/head strides that are multiples of 8 elements (16-byte rows)".into(),
        );
    }
    if ptrs.iter().any(|a| a % 16 != 0) {
        return Some("needs 16-byte aligned q, k, v, o (and gradient) tensors".into());
    }
    None
}

fn kernel(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    name: &str,
    smem: u32,
    mt: usize,
    bwd: BwdGeom,
) -> Result<Kernel> {
    let k = dev.kernel(
        &program(p.dtype, p.head_dim, p.softcap > 0.0, mt, bwd),
        name,
    )?;
    k.allow_dynamic_smem(smem)?;
    Ok(k)
}

fn grid_dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n)
        .map_err(|_| Error::bad_arg(OP, what, "a size whose launch grid fits in 32 bits", n))
}

/// The parameters every flash kernel takes after its tensors, in flash.cu's order: cu_seqlens,
/// head counts, (max) lengths and the (batch, seq, head) strides of q, k, v, o.
fn push_geometry(a: &mut KernelArgs, p: &Problem, cu_q: u64, cu_k: u64) {
    push_sizes(a, p, cu_q, cu_k);
    a.push(Strides::from(p.q_stride))
        .push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(Strides::from(p.o_stride));
}

/// The parameters every attention kernel (flash.cu, hopper.cu) takes after its tensors:
/// cu_seqlens (0 when padded), head counts and the (max) sequence lengths.
pub(super) fn push_sizes(a: &mut KernelArgs, p: &Problem, cu_q: u64, cu_k: u64) {
    a.push(cu_q)
        .push(cu_k)
        .push(p.heads_q as i32)
        .push(p.heads_kv as i32)
        .push(p.seqlen_q as i32)
        .push(p.seqlen_k as i32);
}

/// cu_seqlens pointers (0 = padded batch) and the length of an lse row: Sq when padded
/// (`[B, Hq, Sq]`), the packed query count when varlen (`[Hq, total_q]`).
fn varlen_args(varlen: Option<&Varlen>, p: &Problem, lse: &Tensor) -> Result<(u64, u64, i64)> {
    Ok(match varlen {
        Some(v) => (
            v.cu_seqlens_q.device_ptr()?,
            v.cu_seqlens_k.device_ptr()?,
            *lse.shape().last().unwrap_or(&0) as i64,
        ),
        None => (0, 0, p.seqlen_q as i64),
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<()> {
    forward_with(
        default_fwd_mt(p.head_dim),
        dev,
        stream,
        p,
        q,
        k,
        v,
        o,
        lse,
        varlen,
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward_with(
    mt: usize,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<()> {
    let [smem, _, _] = smem_bytes(p.head_dim, p.dtype, mt);
    let (bm, _, threads) = fwd_tile(mt);
    let kern = kernel(
        dev,
        p,
        "flash_fwd",
        smem,
        mt,
        BwdGeom::default_for(p.head_dim),
    )?;
    let (cu_q, cu_k, lse_rows) = varlen_args(varlen, p, lse)?;
    let mut a = KernelArgs::new();
    a.push(q.device_ptr()?)
        .push(k.device_ptr()?)
        .push(v.device_ptr()?)
        .push(o.device_ptr()?)
        .push(lse.device_ptr()?);
    push_geometry(&mut a, p, cu_q, cu_k);
    a.push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(score_map(p));
    let grid = (
        grid_dim(p.seqlen_q.div_ceil(bm), "seqlen_q")?,
        grid_dim(p.heads_q, "heads_q")?,
        grid_dim(p.batch, "batch")?,
    );
    kern.launch(stream, grid, (threads, 1, 1), smem, &mut a)
}

/// The tensors of one backward call (validated by the caller).
pub(super) struct Bwd<'a> {
    pub dout: &'a Tensor,
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub o: &'a Tensor,
    pub lse: &'a Tensor,
    pub dq: &'a Tensor,
    pub dk: &'a Tensor,
    pub dv: &'a Tensor,
}

/// Launches `kern` unless a grid dimension is 0 (an empty batch, sequence or head set: nothing
/// to do, and a launch of an empty grid is an error).
fn launch_unless_empty(
    kern: &Kernel,
    stream: &Stream,
    grid: (u32, u32, u32),
    threads: u32,
    smem: u32,
    a: &mut KernelArgs,
) -> Result<()> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    kern.launch(stream, grid, (threads, 1, 1), smem, a)
}

pub(super) fn backward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    varlen: Option<&Varlen>,
    mode: BwdMode,
) -> Result<()> {
    let mt = default_fwd_mt(p.head_dim);
    // Kernels of the module the forward uses, unless a non-default geometry was asked for.
    let geom = match mode {
        BwdMode::Atomic(g) => g,
        BwdMode::Deterministic => BwdGeom::default_for(p.head_dim),
    };
    if !geom.fits(p.head_dim) {
        return Err(Error::bad_arg(
            OP,
            "backward geometry",
            format!("one that tiles the dQ product at head dim {}", p.head_dim),
            format!("{geom:?}"),
        ));
    }
    let (delta, seq) = delta(dev, stream, p, t, varlen, mt, geom)?;
    match mode {
        BwdMode::Deterministic => deterministic_dkdv_dq(dev, stream, p, t, &delta, seq, mt, geom),
        BwdMode::Atomic(g) => atomic_dkdvq(dev, stream, p, t, &delta, seq, mt, g),
    }
}

/// Δ_i = Σ_d dO_i·O_i (f32, lse's shape) on `stream`, and the call's (cu_q, cu_k, lse row
/// length) as the backward kernels take them. Shared with the `hopper` backward.
pub(super) fn delta(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    varlen: Option<&Varlen>,
    mt: usize,
    geom: BwdGeom,
) -> Result<(DeviceBuffer, (u64, u64, i64))> {
    let (cu_q, cu_k, lse_rows) = varlen_args(varlen, p, t.lse)?;
    let delta = dev.alloc(t.lse.numel() * 4, stream)?;
    let dot = kernel(dev, p, "flash_bwd_dot", 0, mt, geom)?;
    let rows = p.batch * p.heads_q * p.seqlen_q;
    let mut a = KernelArgs::new();
    a.push(t.dout.device_ptr()?)
        .push(t.o.device_ptr()?)
        .push(delta.ptr())
        .push(cu_q)
        .push(p.batch as i32)
        .push(p.heads_q as i32)
        .push(p.seqlen_q as i32)
        .push(Strides::from(p.o_stride))
        .push(lse_rows);
    launch_unless_empty(
        &dot,
        stream,
        (grid_dim(rows.div_ceil(8), "rows")?, 1, 1),
        256,
        0,
        &mut a,
    )?;
    Ok((delta, (cu_q, cu_k, lse_rows)))
}

/// A zeroed f32 dQ accumulator: rows like lse (B·Hq·Sq padded, Hq·total_q varlen), head_dim
/// floats each, ordered on `stream` before the kernels that add into it.
pub(super) fn dq_accumulator(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
) -> Result<DeviceBuffer> {
    let acc_bytes = t.lse.numel() * p.head_dim * 4;
    let acc = dev.alloc(acc_bytes, stream)?;
    // SAFETY: `acc` is this device's allocation of exactly `acc_bytes` bytes, ordered on `stream`
    // before the kernels that add into it.
    unsafe { dev.memset(acc.ptr(), 0, acc_bytes, stream)? };
    Ok(acc)
}

/// dq = scale·acc in dq's dtype and strides (the last kernel of both atomic backwards).
pub(super) fn convert_dq(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    acc: &DeviceBuffer,
    (cu_q, lse_rows): (u64, i64),
    mt: usize,
    geom: BwdGeom,
) -> Result<()> {
    let conv = kernel(dev, p, "flash_bwd_dq_convert", 0, mt, geom)?;
    let chunks = t.lse.numel() * (p.head_dim / 8);
    let mut a = KernelArgs::new();
    a.push(acc.ptr())
        .push(t.dq.device_ptr()?)
        .push(cu_q)
        .push(p.batch as i32)
        .push(p.heads_q as i32)
        .push(p.seqlen_q as i32)
        .push(Strides::from(p.q_stride))
        .push(lse_rows)
        .push(p.scale);
    launch_unless_empty(
        &conv,
        stream,
        (grid_dim(chunks.div_ceil(256), "rows")?, 1, 1),
        256,
        0,
        &mut a,
    )
}

/// The deterministic backward's two kernels after Δ: dK/dV per key block, dQ per query block.
#[allow(clippy::too_many_arguments)]
fn deterministic_dkdv_dq(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    delta: &DeviceBuffer,
    (cu_q, cu_k, lse_rows): (u64, u64, i64),
    mt: usize,
    geom: BwdGeom,
) -> Result<()> {
    let [_, smem_kv, smem_q] = smem_bytes(p.head_dim, p.dtype, mt);
    let dkdv = kernel(dev, p, "flash_bwd_dkdv", smem_kv, mt, geom)?;
    let mut a = KernelArgs::new();
    a.push(t.q.device_ptr()?)
        .push(t.k.device_ptr()?)
        .push(t.v.device_ptr()?)
        .push(t.dout.device_ptr()?)
        .push(t.lse.device_ptr()?)
        .push(delta.ptr())
        .push(t.dk.device_ptr()?)
        .push(t.dv.device_ptr()?);
    push_geometry(&mut a, p, cu_q, cu_k);
    a.push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(score_map(p))
        .push(p.scale);
    let grid = (
        grid_dim(p.seqlen_k.div_ceil(KV_BN), "seqlen_k")?,
        grid_dim(p.heads_kv, "heads_kv")?,
        grid_dim(p.batch, "batch")?,
    );
    launch_unless_empty(&dkdv, stream, grid, B_THREADS, smem_kv, &mut a)?;

    let dqk = kernel(dev, p, "flash_bwd_dq", smem_q, mt, geom)?;
    let mut a = KernelArgs::new();
    a.push(t.q.device_ptr()?)
        .push(t.k.device_ptr()?)
        .push(t.v.device_ptr()?)
        .push(t.dout.device_ptr()?)
        .push(t.lse.device_ptr()?)
        .push(delta.ptr())
        .push(t.dq.device_ptr()?);
    push_geometry(&mut a, p, cu_q, cu_k);
    a.push(Strides::from(p.q_stride))
        .push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(score_map(p))
        .push(p.scale);
    let grid = (
        grid_dim(p.seqlen_q.div_ceil(Q_BM), "seqlen_q")?,
        grid_dim(p.heads_q, "heads_q")?,
        grid_dim(p.batch, "batch")?,
    );
    launch_unless_empty(&dqk, stream, grid, B_THREADS, smem_q, &mut a)
}

/// The one-pass backward after Δ: a zeroed f32 dQ accumulator, the fused dK/dV/dQ kernel, and
/// the conversion of the accumulator into dq.
#[allow(clippy::too_many_arguments)]
fn atomic_dkdvq(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    delta: &DeviceBuffer,
    (cu_q, cu_k, lse_rows): (u64, u64, i64),
    mt: usize,
    geom: BwdGeom,
) -> Result<()> {
    let acc = dq_accumulator(dev, stream, p, t)?;
    let smem = geom.smem(p.head_dim, p.dtype);
    let fused = kernel(dev, p, "flash_bwd_fused", smem, mt, geom)?;
    let mut a = KernelArgs::new();
    a.push(t.q.device_ptr()?)
        .push(t.k.device_ptr()?)
        .push(t.v.device_ptr()?)
        .push(t.dout.device_ptr()?)
        .push(t.lse.device_ptr()?)
        .push(delta.ptr())
        .push(t.dk.device_ptr()?)
        .push(t.dv.device_ptr()?)
        .push(acc.ptr());
    push_geometry(&mut a, p, cu_q, cu_k);
    a.push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(score_map(p))
        .push(p.scale);
    let grid = (
        grid_dim(p.seqlen_k.div_ceil(geom.keys()), "seqlen_k")?,
        grid_dim(p.heads_kv, "heads_kv")?,
        grid_dim(p.batch, "batch")?,
    );
    launch_unless_empty(&fused, stream, grid, (geom.warps * 32) as u32, smem, &mut a)?;

    convert_dq(dev, stream, p, t, &acc, (cu_q, lse_rows), mt, geom)
}

#[cfg(test)]
mod tests;
