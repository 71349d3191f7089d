//! Host code of the `hopper` rung (kernels/hopper.cu): attention forward and backward on wgmma +
//! TMA with warp-specialised producer/consumer warpgroups (sm_90a). The backward shares Δ and
//! the dq conversion with `flash`, and falls back to flash's kernels where the wgmma one does not
//! apply (soft-capping, `deterministic`).

use super::flash::{self, Bwd, BwdGeom};
use super::{Problem, Varlen, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::tma::{self, TmaDesc};
use crate::core::cuda::{CudaDevice, KernelArgs, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("attention/hopper", "kernels/hopper.cu");
pub const HEAD_DIMS: [usize; 2] = [64, 128];
const BM: usize = 128;
const BN: usize = 128;
const THREADS: u32 = 384;
/// Keys per block, queries per step and Q/dO ring depth of the backward (attn_hopper_bwd).
const BWD_BN: usize = 128;
const BWD_BM: usize = 64;
const BWD_STAGES: usize = 2;

/// Kernel configuration: the depth of the (K, V) ring and whether a warpgroup overlaps its
/// softmax with its own P·V (FE_PIPE in hopper.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    pub stages: usize,
    pub pipelined: bool,
}

impl Config {
    /// Fastest or within 3% of it in every case of the H100 sweep (B4 H16 S4096, D 64/128,
    /// causal and not; see docs/attention.md).
    pub const DEFAULT: Config = Config {
        stages: 3,
        pipelined: true,
    };
    pub const ALL: [Config; 4] = [
        Config {
            stages: 2,
            pipelined: false,
        },
        Config {
            stages: 2,
            pipelined: true,
        },
        Config {
            stages: 3,
            pipelined: false,
        },
        Config {
            stages: 3,
            pipelined: true,
        },
    ];
}

pub fn program(dtype: DType, head_dim: usize, cfg: Config, softcap: bool) -> Program {
    Program::new(SRC)
        .define("FE_SOFTCAP", softcap as u32)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_HEAD_DIM", head_dim)
        .define("FE_WGMMA_BF16", (dtype == DType::BF16) as u32)
        .define("FE_STAGES", cfg.stages)
        .define("FE_PIPE", cfg.pipelined as u32)
}

/// The backward's module: attn_hopper_bwd only (FE_BWD=1).
pub fn program_bwd(dtype: DType, head_dim: usize) -> Program {
    Program::new(SRC)
        .define("FE_BWD", 1)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_HEAD_DIM", head_dim)
        .define("FE_WGMMA_BF16", (dtype == DType::BF16) as u32)
        .define("FE_BWD_STAGES", BWD_STAGES)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::BF16, DType::F16] {
        for hd in HEAD_DIMS {
            v.push(KernelSpec {
                program: program_bwd(d, hd),
                functions: vec!["attn_hopper_bwd".into()],
                min_arch: Arch::SM90,
            });
            for (cfg, softcap) in [
                (Config::DEFAULT, false),
                (Config::DEFAULT, true),
                (Config::ALL[0], false),
            ] {
                v.push(KernelSpec {
                    program: program(d, hd, cfg, softcap),
                    functions: vec!["attn_hopper_fwd".into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    v
}

/// Why `hopper` cannot run this forward problem (None when it can).
pub fn unfit(p: &Problem, ptrs: &[u64]) -> Option<String> {
    if !matches!(p.dtype, DType::BF16 | DType::F16) {
        return Some(format!("needs bf16 or f16 (got {})", p.dtype));
    }
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Some(format!("needs head dim 64 or 128 (got {})", p.head_dim));
    }
    // A packed varlen batch has no batch stride (the map gives it extent 1).
    let first = if p.varlen { 1 } else { 0 };
    let strides = [p.q_stride, p.k_stride, p.v_stride, p.o_stride];
    if strides
        .iter()
        .any(|s| s[first..].iter().any(|&x| x % 8 != 0 || x <= 0))
    {
        return Some(
            "needs positive batch/seq/head strides, multiples of 8 elements (TMA: 16-byte strides)"
                .into(),
        );
    }
    if ptrs.iter().any(|a| a % 16 != 0) {
        return Some("needs 16-byte aligned q, k, v, o (TMA)".into());
    }
    None
}

/// Why the wgmma backward cannot take this problem (None when it can); `hopper` then runs
/// flash's backward kernels. `ptrs` are every q/k/v/o-like and gradient tensor of the call.
pub fn unfit_backward(p: &Problem, ptrs: &[u64], deterministic: bool) -> Option<String> {
    if deterministic {
        return Some("deterministic: dQ is summed with atomics".into());
    }
    if p.softcap > 0.0 {
        return Some("soft-capping is not compiled into the wgmma backward".into());
    }
    unfit(p, ptrs)
}

/// Which tensor-map coordinate (1..=3) carries row, head and batch, as `MapOrder` in hopper.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MapOrder {
    row: i32,
    head: i32,
    batch: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScoreMap {
    scale_log2: f32,
    cap_in: f32,
    cap_out_log2: f32,
    capped: i32,
}

/// The 4-D tensor map (d, then row/head/batch ordered by increasing stride) of q, k or v, boxes
/// of 64 (d) × `box_rows`, 128-byte swizzle, zero fill outside.
fn tensor_map(
    dtype: DType,
    ptr: u64,
    head_dim: usize,
    (rows, heads, batch): (usize, usize, usize),
    stride: [i64; 3],
    box_rows: u32,
) -> Result<(TmaDesc, MapOrder)> {
    let es = dtype.size_in_bytes() as u64;
    // (extent, stride in bytes, which: 0 row, 1 head, 2 batch)
    let mut outer = [
        (rows.max(1) as u64, stride[1] as u64 * es, 0),
        (heads.max(1) as u64, stride[2] as u64 * es, 1),
        (batch.max(1) as u64, stride[0] as u64 * es, 2),
    ];
    outer.sort_by_key(|&(_, s, _)| s);
    let dims = [head_dim as u64, outer[0].0, outer[1].0, outer[2].0];
    let strides = [outer[0].1, outer[1].1, outer[2].1];
    let mut order = [0i32; 3];
    for (slot, &(_, _, which)) in outer.iter().enumerate() {
        order[which] = slot as i32 + 1;
    }
    // The box spans `box_rows` along the row dim, wherever the stride order put it.
    let mut boxd = [64u32, 1, 1, 1];
    for (slot, &(_, _, which)) in outer.iter().enumerate() {
        if which == 0 {
            boxd[slot + 1] = box_rows;
        }
    }
    let map = tma::encode(dtype, ptr, dims, &strides, boxd, true)?;
    let order = MapOrder {
        row: order[0],
        head: order[1],
        batch: order[2],
        pad: 0,
    };
    Ok((map, order))
}

/// The tensor maps of one call: padded, rows = the padded seq length per batch; varlen, rows =
/// the packed totals and a batch dim of extent 1.
struct Maps<'a> {
    p: &'a Problem,
    varlen: bool,
    q_rows: usize,
    k_rows: usize,
    batch: usize,
}

impl<'a> Maps<'a> {
    fn new(p: &'a Problem, varlen: bool, q_rows: usize, k_rows: usize, batch: usize) -> Self {
        Maps {
            p,
            varlen,
            q_rows,
            k_rows,
            batch,
        }
    }

    /// Varlen: the batch dim has extent 1; give it a valid stride past the whole tensor.
    fn batch_stride(&self, s: [i64; 3], rows: usize) -> [i64; 3] {
        if self.varlen {
            [s[1].max(s[2]) * rows.max(1) as i64, s[1], s[2]]
        } else {
            s
        }
    }

    /// A map over q-like rows (q, or dO with o's strides), boxes of `box_rows` rows.
    fn query_side(
        &self,
        ptr: u64,
        stride: [i64; 3],
        box_rows: usize,
    ) -> Result<(TmaDesc, MapOrder)> {
        let p = self.p;
        tensor_map(
            p.dtype,
            ptr,
            p.head_dim,
            (self.q_rows, p.heads_q, self.batch),
            self.batch_stride(stride, self.q_rows),
            box_rows as u32,
        )
    }

    /// The maps of k and v (which must share their dim order), boxes of `box_rows` rows.
    fn key_side(
        &self,
        k: &Tensor,
        v: &Tensor,
        box_rows: usize,
    ) -> Result<(TmaDesc, MapOrder, TmaDesc)> {
        let p = self.p;
        let map = |ptr: u64, stride: [i64; 3]| {
            tensor_map(
                p.dtype,
                ptr,
                p.head_dim,
                (self.k_rows, p.heads_kv, self.batch),
                self.batch_stride(stride, self.k_rows),
                box_rows as u32,
            )
        };
        let (tk, okv) = map(k.device_ptr()?, p.k_stride)?;
        let (tv, ov) = map(v.device_ptr()?, p.v_stride)?;
        if (ov.row, ov.head, ov.batch) != (okv.row, okv.head, okv.batch) {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: "CUDA variant `hopper` needs k and v in the same layout".into(),
            });
        }
        Ok((tk, okv, tv))
    }
}

/// K, V, the Q/dO ring, two dSᵀ tiles, the ring's lse/Δ rows and the barriers (+ 1 KiB to align
/// the swizzled tiles), as attn_hopper_bwd lays them out.
fn smem_bytes_bwd(head_dim: usize) -> u32 {
    let kv = 2 * BWD_BN * head_dim * 2;
    let ring = BWD_STAGES * 2 * BWD_BM * head_dim * 2;
    let ds = 2 * BWD_BN * BWD_BM * 2;
    let rows = BWD_STAGES * 2 * BWD_BM * 4;
    (1024 + kv + ring + ds + rows + 8 * (1 + 2 * BWD_STAGES)) as u32
}

fn smem_bytes(head_dim: usize, stages: usize) -> u32 {
    let q = BM * head_dim * 2;
    let kv = 2 * BN * head_dim * 2;
    (1024 + q + stages * kv + 8 * (1 + 3 * stages)) as u32
}

/// Padded: rows = the padded seq length per batch; varlen: rows = the packed total, batch 1.
/// With the cu_seqlens pointers (0 when padded) and the length of an lse row.
fn extents(
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<(usize, usize, usize, u64, u64, i64)> {
    Ok(match varlen {
        Some(vl) => (
            q.shape()[0],
            k.shape()[0],
            1,
            vl.cu_seqlens_q.device_ptr()?,
            vl.cu_seqlens_k.device_ptr()?,
            *lse.shape().last().unwrap_or(&0) as i64,
        ),
        None => (p.seqlen_q, p.seqlen_k, p.batch, 0, 0, p.seqlen_q as i64),
    })
}

/// Element strides (batch, seq, head) as three i64 parameters.
fn push_strides(a: &mut KernelArgs, s: [i64; 3]) {
    a.push(s[0]).push(s[1]).push(s[2]);
}

/// How much of L2 (50 MiB on the H100) one chunk of units may fill with the tiles its blocks
/// re-read: a third, so the streamed tiles and the other chunk in flight fit beside it.
const SCHEDULE_L2_BYTES: usize = 16 << 20;

/// The launch order of hopper.cu's `schedule`: `units` (batch, head) pairs of `nblk` blocks each,
/// on a 1-D grid, in chunks of `chunk` units taken rank by rank (each unit's heaviest block
/// first). Under a mask (causal, window) the blocks' work differs, so a chunk holds as many
/// units as keep their re-read tiles (`reread` bytes a unit) in L2: the heavy blocks of all of
/// them go out before the light ones, which fill the tail. Without a mask every block does the
/// same work and chunk = 1 keeps one unit's blocks together (the best L2 reuse).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Schedule {
    units: usize,
    nblk: usize,
    chunk: usize,
}

impl Schedule {
    fn new(p: &Problem, units: usize, nblk: usize, reread: usize) -> Schedule {
        let masked = p.window_left >= 0 || p.window_right >= 0;
        let chunk = if masked {
            (SCHEDULE_L2_BYTES / reread.max(1)).clamp(1, units.max(1))
        } else {
            1
        };
        Schedule { units, nblk, chunk }
    }

    /// The 1-D grid (CUDA's x dimension: at most 2³¹ − 1 blocks).
    fn grid(&self, what: &str) -> Result<(u32, u32, u32)> {
        let n = self.units * self.nblk;
        match i32::try_from(n) {
            Ok(_) => Ok((n as u32, 1, 1)),
            Err(_) => Err(Error::bad_arg(
                OP,
                what,
                "at most 2^31 - 1 blocks of 128 rows over batch × heads",
                n,
            )),
        }
    }

    fn push(&self, a: &mut KernelArgs) {
        a.push(self.units as i32)
            .push(self.nblk as i32)
            .push(self.chunk as i32);
    }
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
    forward_with(Config::DEFAULT, dev, stream, p, q, k, v, o, lse, varlen)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward_with(
    cfg: Config,
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
    let (q_rows, k_rows, batch, cu_q, cu_k, lse_rows) = extents(p, q, k, lse, varlen)?;
    let maps = Maps::new(p, varlen.is_some(), q_rows, k_rows, batch);
    let (tq, oq) = maps.query_side(q.device_ptr()?, p.q_stride, BM)?;
    let (tk, okv, tv) = maps.key_side(k, v, BN)?;
    let log2e = std::f32::consts::LOG2_E;
    let capped = p.softcap > 0.0;
    let smap = ScoreMap {
        scale_log2: p.scale * log2e,
        cap_in: if capped { p.scale / p.softcap } else { 0.0 },
        cap_out_log2: if capped { p.softcap * log2e } else { 0.0 },
        capped: capped as i32,
    };
    let smem = smem_bytes(p.head_dim, cfg.stages);
    let kern = dev.kernel(
        &program(p.dtype, p.head_dim, cfg, p.softcap > 0.0),
        "attn_hopper_fwd",
    )?;
    kern.set_max_dynamic_smem(smem)?;
    let mut a = KernelArgs::new();
    a.push(tq)
        .push(tk)
        .push(tv)
        .push(oq)
        .push(okv)
        .push(o.device_ptr()?)
        .push(lse.device_ptr()?);
    flash::push_sizes(&mut a, p, cu_q, cu_k);
    push_strides(&mut a, p.o_stride);
    a.push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(smap);
    // A query head re-reads its kv head's K and V (shared by the GQA group's heads).
    let group = p.heads_q / p.heads_kv.max(1);
    let kv_bytes = 2 * p.seqlen_k * p.head_dim * 2 / group.max(1);
    let sched = Schedule::new(p, p.batch * p.heads_q, p.seqlen_q.div_ceil(BM), kv_bytes);
    sched.push(&mut a);
    let grid = sched.grid("seqlen_q")?;
    if grid.0 == 0 {
        return Ok(());
    }
    kern.launch(stream, grid, (THREADS, 1, 1), smem, &mut a)
}

/// The wgmma backward (after `unfit_backward` said it applies): Δ and a zeroed f32 dQ
/// accumulator (flash's), attn_hopper_bwd over (128-key block, kv head, batch), then dq from the
/// accumulator (flash's conversion).
pub(super) fn backward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    t: &Bwd,
    varlen: Option<&Varlen>,
) -> Result<()> {
    let mt = flash::default_fwd_mt(p.head_dim);
    let geom = BwdGeom::default_for(p.head_dim);
    let (delta, (cu_q, cu_k, lse_rows)) = flash::delta(dev, stream, p, t, varlen, mt, geom)?;
    let acc = flash::dq_accumulator(dev, stream, p, t)?;

    let (q_rows, k_rows, batch, _, _, _) = extents(p, t.q, t.k, t.lse, varlen)?;
    let maps = Maps::new(p, varlen.is_some(), q_rows, k_rows, batch);
    let (tq, oq) = maps.query_side(t.q.device_ptr()?, p.q_stride, BWD_BM)?;
    // dO has o's strides (its own dim order).
    let (tdo, odo) = maps.query_side(t.dout.device_ptr()?, p.o_stride, BWD_BM)?;
    let (tk, okv, tv) = maps.key_side(t.k, t.v, BWD_BN)?;

    let smem = smem_bytes_bwd(p.head_dim);
    let kern = dev.kernel(&program_bwd(p.dtype, p.head_dim), "attn_hopper_bwd")?;
    kern.allow_dynamic_smem(smem)?;
    let mut a = KernelArgs::new();
    a.push(tq)
        .push(tk)
        .push(tv)
        .push(tdo)
        .push(oq)
        .push(odo)
        .push(okv)
        .push(t.lse.device_ptr()?)
        .push(delta.ptr())
        .push(t.dk.device_ptr()?)
        .push(t.dv.device_ptr()?)
        .push(acc.ptr());
    flash::push_sizes(&mut a, p, cu_q, cu_k);
    push_strides(&mut a, p.k_stride);
    push_strides(&mut a, p.v_stride);
    a.push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(p.scale * std::f32::consts::LOG2_E)
        .push(p.scale);
    // A (batch, kv head) unit re-reads Q and dO of its group's query heads.
    let group = p.heads_q / p.heads_kv.max(1);
    let qdo_bytes = group * 2 * p.seqlen_q * p.head_dim * 2;
    let sched = Schedule::new(
        p,
        p.batch * p.heads_kv,
        p.seqlen_k.div_ceil(BWD_BN),
        qdo_bytes,
    );
    sched.push(&mut a);
    let grid = sched.grid("seqlen_k")?;
    if grid.0 > 0 {
        kern.launch(stream, grid, (THREADS, 1, 1), smem, &mut a)?;
    }
    flash::convert_dq(dev, stream, p, t, &acc, (cu_q, lse_rows), mt, geom)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(b: usize, h: usize, s: usize, d: usize, wl: i64, wr: i64) -> Problem {
        let cpu = crate::core::device::Device::Cpu;
        Problem {
            window_left: wl,
            window_right: wr,
            ..Problem::padded_bshd(b, (h, h), (s, s), d, DType::BF16, cpu)
        }
    }

    /// Without a mask one unit's blocks stay together (chunk 1); under a causal mask a chunk holds
    /// as many units as share L2 (all of them at short sequences, few at long ones), never 0.
    #[test]
    fn schedule_chunks_units_only_under_a_mask() {
        let kv = |s: usize, d: usize| 2 * s * d * 2;
        let plain = problem(4, 16, 4096, 128, -1, -1);
        assert_eq!(Schedule::new(&plain, 64, 32, kv(4096, 128)).chunk, 1);
        let causal = problem(4, 16, 4096, 128, -1, 0);
        assert_eq!(Schedule::new(&causal, 64, 32, kv(4096, 128)).chunk, 8);
        assert_eq!(Schedule::new(&causal, 64, 8, kv(1024, 64)).chunk, 64);
        assert_eq!(Schedule::new(&causal, 64, 128, kv(16384, 128)).chunk, 2);
        assert_eq!(Schedule::new(&causal, 3, 4096, kv(1 << 22, 128)).chunk, 1);
        let window = problem(1, 2, 100, 64, 16, -1);
        assert_eq!(Schedule::new(&window, 2, 1, kv(100, 64)).chunk, 2);
        assert_eq!(
            Schedule::new(&causal, 64, 32, kv(4096, 128))
                .grid("s")
                .unwrap(),
            (64 * 32, 1, 1)
        );
        assert!(Schedule::new(&causal, 1 << 20, 1 << 12, 1)
            .grid("s")
            .is_err());
    }

    /// The backward's layout must fit one block on an SM (227 KiB opt-in on sm_90) and match the
    /// offsets attn_hopper_bwd computes: 1024-aligned swizzled tiles, then rows, then barriers.
    #[test]
    fn backward_smem_fits_hopper_and_keeps_tiles_aligned() {
        for d in HEAD_DIMS {
            let bytes = smem_bytes_bwd(d) as usize;
            assert!(bytes <= 227 * 1024, "head dim {d}: {bytes} bytes");
            // K, V, each ring stage and each dSᵀ tile start on a 1024-byte swizzle atom.
            for tile in [BWD_BN * d * 2, BWD_BM * d * 2 * 2, BWD_BN * BWD_BM * 2] {
                assert_eq!(tile % 1024, 0, "head dim {d}: tile of {tile} bytes");
            }
        }
        // A forward's smem and the backward's differ (the backward keeps K and V whole).
        assert!(smem_bytes_bwd(128) > smem_bytes(128, 2));
    }

    #[test]
    fn backward_falls_back_where_the_wgmma_kernel_does_not_apply() {
        let cpu = crate::core::device::Device::Cpu;
        let p = Problem {
            scale: 0.1,
            window_right: 0,
            ..Problem::padded_bshd(1, (4, 2), (100, 130), 128, DType::BF16, cpu)
        };
        let ptrs = [4096u64; 8];
        assert_eq!(unfit_backward(&p, &ptrs, false), None);
        assert!(unfit_backward(&p, &ptrs, true).is_some(), "deterministic");
        let capped = Problem { softcap: 30.0, ..p };
        assert!(unfit_backward(&capped, &ptrs, false).is_some(), "soft-cap");
        let d96 = Problem { head_dim: 96, ..p };
        assert!(unfit_backward(&d96, &ptrs, false).is_some(), "head dim 96");
        assert!(
            unfit_backward(&p, &[4096, 4098, 4096], false).is_some(),
            "misaligned"
        );
    }
}
