//! Host code of the `flash` rung (kernels/flash.cu): FlashAttention-2-style forward and a
//! deterministic two-kernel backward on mma.sync tensor cores (sm_80+).

use super::{Problem, Varlen, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("attention/flash", "kernels/flash.cu");
const FUNCS: [&str; 4] = ["flash_fwd", "flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq"];

/// Head dims the kernels are specialised for.
pub const HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];

// Tile geometry, as in flash.cu.
const F_BM: usize = 128;
const F_BN: usize = 64;
const F_THREADS: u32 = 256;
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
        Strides { b: s[0], s: s[1], h: s[2] }
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

pub fn program(dtype: DType, head_dim: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_HEAD_DIM", head_dim)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::BF16, DType::F16] {
        for hd in HEAD_DIMS {
            v.push(KernelSpec {
                program: program(d, hd),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
        }
    }
    v
}

fn smem_bytes(head_dim: usize, dtype: DType) -> [u32; 3] {
    let lds = head_dim + 8;
    let es = dtype.size_in_bytes();
    [
        ((F_BM + 4 * F_BN) * lds * es) as u32,
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
    let strides = [p.q_stride, p.k_stride, p.v_stride, p.o_stride];
    if strides.iter().flatten().any(|s| s % 8 != 0) {
        return Some("needs batch/seq/head strides that are multiples of 8 elements (16-byte rows)".into());
    }
    if ptrs.iter().any(|a| a % 16 != 0) {
        return Some("needs 16-byte aligned q, k, v, o (and gradient) tensors".into());
    }
    None
}

fn kernel(dev: &Arc<CudaDevice>, p: &Problem, name: &str, smem: u32) -> Result<Kernel> {
    let k = dev.kernel(&program(p.dtype, p.head_dim), name)?;
    if smem > 48 * 1024 {
        k.set_max_dynamic_smem(smem)?;
    }
    Ok(k)
}

fn grid_dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        Error::bad_arg(OP, what, "a size whose launch grid fits in 32 bits", n)
    })
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
    let [smem, _, _] = smem_bytes(p.head_dim, p.dtype);
    let kern = kernel(dev, p, "flash_fwd", smem)?;
    let (cu_q, cu_k, lse_rows) = varlen_args(varlen, p, lse)?;
    let mut a = KernelArgs::new();
    a.push(q.device_ptr()?)
        .push(k.device_ptr()?)
        .push(v.device_ptr()?)
        .push(o.device_ptr()?)
        .push(lse.device_ptr()?)
        .push(cu_q)
        .push(cu_k)
        .push(p.heads_q as i32)
        .push(p.heads_kv as i32)
        .push(p.seqlen_q as i32)
        .push(p.seqlen_k as i32)
        .push(Strides::from(p.q_stride))
        .push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(Strides::from(p.o_stride))
        .push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(score_map(p));
    let grid = (
        grid_dim(p.seqlen_q.div_ceil(F_BM), "seqlen_q")?,
        grid_dim(p.heads_q, "heads_q")?,
        grid_dim(p.batch, "batch")?,
    );
    kern.launch(stream, grid, (F_THREADS, 1, 1), smem, &mut a)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<()> {
    let [_, smem_kv, smem_q] = smem_bytes(p.head_dim, p.dtype);
    let (cu_q, cu_k, lse_rows) = varlen_args(varlen, p, lse)?;
    // Δ has lse's shape.
    let delta = dev.alloc(lse.numel() * 4, stream)?;

    let dot = kernel(dev, p, "flash_bwd_dot", 0)?;
    let rows = p.batch * p.heads_q * p.seqlen_q;
    let mut a = KernelArgs::new();
    a.push(dout.device_ptr()?)
        .push(o.device_ptr()?)
        .push(delta.ptr())
        .push(cu_q)
        .push(p.batch as i32)
        .push(p.heads_q as i32)
        .push(p.seqlen_q as i32)
        .push(Strides::from(p.o_stride))
        .push(lse_rows);
    dot.launch(stream, (grid_dim(rows.div_ceil(8), "rows")?, 1, 1), (256, 1, 1), 0, &mut a)?;

    let dkdv = kernel(dev, p, "flash_bwd_dkdv", smem_kv)?;
    let mut a = KernelArgs::new();
    a.push(q.device_ptr()?)
        .push(k.device_ptr()?)
        .push(v.device_ptr()?)
        .push(dout.device_ptr()?)
        .push(lse.device_ptr()?)
        .push(delta.ptr())
        .push(dk.device_ptr()?)
        .push(dv.device_ptr()?)
        .push(cu_q)
        .push(cu_k)
        .push(p.heads_q as i32)
        .push(p.heads_kv as i32)
        .push(p.seqlen_q as i32)
        .push(p.seqlen_k as i32)
        .push(Strides::from(p.q_stride))
        .push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(Strides::from(p.o_stride))
        .push(Strides::from(p.k_stride))
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
    dkdv.launch(stream, grid, (B_THREADS, 1, 1), smem_kv, &mut a)?;

    let dqk = kernel(dev, p, "flash_bwd_dq", smem_q)?;
    let mut a = KernelArgs::new();
    a.push(q.device_ptr()?)
        .push(k.device_ptr()?)
        .push(v.device_ptr()?)
        .push(dout.device_ptr()?)
        .push(lse.device_ptr()?)
        .push(delta.ptr())
        .push(dq.device_ptr()?)
        .push(cu_q)
        .push(cu_k)
        .push(p.heads_q as i32)
        .push(p.heads_kv as i32)
        .push(p.seqlen_q as i32)
        .push(p.seqlen_k as i32)
        .push(Strides::from(p.q_stride))
        .push(Strides::from(p.k_stride))
        .push(Strides::from(p.v_stride))
        .push(Strides::from(p.o_stride))
        .push(Strides::from(p.q_stride))
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
    dqk.launch(stream, grid, (B_THREADS, 1, 1), smem_q, &mut a)
}
