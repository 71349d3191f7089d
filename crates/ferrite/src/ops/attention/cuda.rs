//! CUDA host code of the attention family. Each variant is an arm of the `match` in `forward` and
//! `backward`; kernels get raw pointers plus the Problem's fields (see `Params`).

use super::{AttentionOptions, BwdTensors, Problem, Seqs, Varlen, OP, OP_BWD};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, rows, CudaDevice, DeviceBuffer, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const NAIVE: KernelSource = kernel_source!("attention/naive", "kernels/naive.cu");
pub const NAIVE_FUNCS: [&str; 8] = [
    "attn_naive_scores",
    "attn_naive_softmax",
    "attn_naive_pv",
    "attn_naive_bwd_dot",
    "attn_naive_bwd_dp",
    "attn_naive_bwd_ds",
    "attn_naive_bwd_dq",
    "attn_naive_bwd_dkv",
];

pub fn naive_program(dtype: DType) -> Program {
    Program::new(NAIVE).define("FE_ELEM", dtype.cuda_name())
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(|d| KernelSpec {
            program: naive_program(d),
            functions: NAIVE_FUNCS.iter().map(|s| s.to_string()).collect(),
            min_arch: Arch::SM80,
        })
        .chain(super::flash::kernel_specs())
        .chain(super::hopper::kernel_specs())
        .collect()
}

/// The kernels' parameter block; must match `struct Params` in kernels/naive.cu field for field
/// (all 8-byte fields first, then the two floats: no padding differences between Rust and C).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub batch: i64,
    pub heads_q: i64,
    pub heads_kv: i64,
    pub seqlen_q: i64,
    pub seqlen_k: i64,
    pub head_dim: i64,
    /// Varlen: packed q rows (the row length of lse); padded: B·Sq.
    pub total_q: i64,
    pub window_left: i64,
    pub window_right: i64,
    pub q_stride: [i64; 3],
    pub k_stride: [i64; 3],
    pub v_stride: [i64; 3],
    pub o_stride: [i64; 3],
    /// Device pointers to the i32 cu_seqlens, 0 when padded.
    pub cu_q: u64,
    pub cu_k: u64,
    pub scale: f32,
    pub softcap: f32,
}

// The C side asserts the same size.
const _: () = assert!(std::mem::size_of::<Params>() == 192);

impl Params {
    pub fn new(p: &Problem, seqs: &Seqs, cu: Option<(u64, u64)>) -> Params {
        let (cu_q, cu_k) = cu.unwrap_or((0, 0));
        Params {
            batch: p.batch as i64,
            heads_q: p.heads_q as i64,
            heads_kv: p.heads_kv as i64,
            seqlen_q: p.seqlen_q as i64,
            seqlen_k: p.seqlen_k as i64,
            head_dim: p.head_dim as i64,
            total_q: seqs.total_q as i64,
            window_left: p.window_left,
            window_right: p.window_right,
            q_stride: p.q_stride,
            k_stride: p.k_stride,
            v_stride: p.v_stride,
            o_stride: p.o_stride,
            cu_q,
            cu_k,
            scale: p.scale,
            softcap: p.softcap,
        }
    }
}

fn ctx(p: &Problem, opts: &AttentionOptions) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = p.device else {
        unreachable!("attention cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let s = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

fn cu_ptrs(varlen: Option<&Varlen>) -> Result<Option<(u64, u64)>> {
    varlen
        .map(|v| Ok((v.cu_seqlens_q.device_ptr()?, v.cu_seqlens_k.device_ptr()?)))
        .transpose()
}

fn no_variant(op: &str, name: &str) -> Error {
    Error::NoVariant {
        op: op.into(),
        msg: format!("no CUDA variant named `{name}`"),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    variant: &str,
    p: &Problem,
    seqs: &Seqs,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
    opts: &AttentionOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, opts)?;
    let prm = Params::new(p, seqs, cu_ptrs(varlen)?);
    match variant {
        "naive" => naive_forward(
            &dev,
            &stream,
            &prm,
            p.dtype,
            [o.device_ptr()?, lse.device_ptr()?],
            [q.device_ptr()?, k.device_ptr()?, v.device_ptr()?],
        ),
        "flash" => super::flash::forward(&dev, &stream, p, q, k, v, o, lse, varlen),
        "hopper" => super::hopper::forward(&dev, &stream, p, q, k, v, o, lse, varlen),
        other => Err(no_variant(OP, other)),
    }
}

pub(super) fn backward(
    variant: &str,
    p: &Problem,
    seqs: &Seqs,
    t: &BwdTensors,
    varlen: Option<&Varlen>,
    opts: &AttentionOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, opts)?;
    let prm = Params::new(p, seqs, cu_ptrs(varlen)?);
    match variant {
        "naive" => naive_backward(&dev, &stream, &prm, p.dtype, t),
        "flash" | "hopper" => {
            let bwd = super::flash::Bwd {
                dout: t.dout,
                q: t.q,
                k: t.k,
                v: t.v,
                o: t.o,
                lse: t.lse,
                dq: t.dq,
                dk: t.dk,
                dv: t.dv,
            };
            // hopper's own backward (wgmma) where it applies; otherwise flash's: one pass with
            // atomic dQ by default, the three-kernel path without atomics for `deterministic`.
            if variant == "hopper" {
                let ptrs = [t.dout, t.q, t.k, t.v, t.o, t.dq, t.dk, t.dv]
                    .iter()
                    .map(|x| x.device_ptr())
                    .collect::<Result<Vec<_>>>()?;
                if super::hopper::unfit_backward(p, &ptrs, opts.deterministic).is_none() {
                    return super::hopper::backward(&dev, &stream, p, &bwd, varlen);
                }
            }
            super::flash::backward(
                &dev,
                &stream,
                p,
                &bwd,
                varlen,
                super::flash::BwdMode::of(opts.deterministic, p.head_dim),
            )
        }
        other => Err(no_variant(OP_BWD, other)),
    }
}

const THREADS: u32 = 256;

/// Blocks for a grid-stride loop over `n` elements (0 when there is nothing to do).
fn blocks_for(n: i64) -> u32 {
    (n.max(0) as u64).div_ceil(THREADS as u64).min(1 << 20) as u32
}

/// Elements of one B·Hq·Sq·Sk workspace.
fn score_elems(prm: &Params) -> i64 {
    prm.batch * prm.heads_q * prm.seqlen_q * prm.seqlen_k
}

fn workspace(dev: &Arc<CudaDevice>, stream: &Stream, floats: i64) -> Result<DeviceBuffer> {
    dev.alloc(floats.max(0) as usize * 4, stream)
}

/// Launches `f` of the naive module over a grid-stride range of `n` elements (skipped when 0).
#[allow(clippy::too_many_arguments)]
fn launch_elems(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    dtype: DType,
    f: &str,
    n: i64,
    ptrs: &[u64],
    prm: &Params,
) -> Result<()> {
    let g = blocks_for(n);
    if g == 0 {
        return Ok(());
    }
    let kern = dev.kernel(&naive_program(dtype), f)?;
    let mut a = KernelArgs::new();
    for &x in ptrs {
        a.push(x);
    }
    a.push(*prm);
    kern.launch(stream, (g, 1, 1), (THREADS, 1, 1), 0, &mut a)
}

/// S = softcap(scale·q·kᵀ) into `ws`.
fn naive_scores(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    prm: &Params,
    dtype: DType,
    ws: u64,
    q: u64,
    k: u64,
) -> Result<()> {
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_scores",
        score_elems(prm),
        &[ws, q, k],
        prm,
    )
}

/// out = [o, lse], ins = [q, k, v].
pub fn naive_forward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    prm: &Params,
    dtype: DType,
    out: [u64; 2],
    ins: [u64; 3],
) -> Result<()> {
    let [o, lse] = out;
    let [q, k, v] = ins;
    // Freed (stream-ordered) when this function returns, after the kernels queued on `stream`.
    let ws = workspace(dev, stream, score_elems(prm))?;
    naive_scores(dev, stream, prm, dtype, ws.ptr(), q, k)?;
    let rows = prm.batch * prm.heads_q * prm.seqlen_q;
    if rows > 0 {
        let kern = dev.kernel(&naive_program(dtype), "attn_naive_softmax")?;
        let threads = rows::threads_scalar(prm.seqlen_k as usize);
        let mut a = KernelArgs::new();
        a.push(ws.ptr()).push(lse).push(*prm);
        kern.launch(
            stream,
            (rows.min(1 << 20) as u32, 1, 1),
            (threads, 1, 1),
            0,
            &mut a,
        )?;
    }
    let n = prm.batch * prm.seqlen_q * prm.heads_q * prm.head_dim;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_pv",
        n,
        &[o, ws.ptr(), v],
        prm,
    )
}

pub fn naive_backward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    prm: &Params,
    dtype: DType,
    t: &BwdTensors,
) -> Result<()> {
    let (dout, q, k, v, o, lse) = (
        t.dout.device_ptr()?,
        t.q.device_ptr()?,
        t.k.device_ptr()?,
        t.v.device_ptr()?,
        t.o.device_ptr()?,
        t.lse.device_ptr()?,
    );
    let (dq, dk, dv) = (t.dq.device_ptr()?, t.dk.device_ptr()?, t.dv.device_ptr()?);
    let n_s = score_elems(prm);
    let ws_p = workspace(dev, stream, n_s)?;
    let ws_ds = workspace(dev, stream, n_s)?;
    // D is indexed like lse: its element count is lse's, B·Hq·Sq or Hq·total_q.
    let n_rows = (prm.batch * prm.seqlen_q).max(prm.total_q) * prm.heads_q;
    let dsum = workspace(dev, stream, n_rows)?;
    naive_scores(dev, stream, prm, dtype, ws_p.ptr(), q, k)?;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_bwd_dot",
        prm.batch * prm.heads_q * prm.seqlen_q,
        &[dsum.ptr(), dout, o],
        prm,
    )?;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_bwd_dp",
        n_s,
        &[ws_ds.ptr(), dout, v],
        prm,
    )?;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_bwd_ds",
        n_s,
        &[ws_p.ptr(), ws_ds.ptr(), lse, dsum.ptr()],
        prm,
    )?;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_bwd_dq",
        prm.batch * prm.seqlen_q * prm.heads_q * prm.head_dim,
        &[dq, ws_ds.ptr(), k],
        prm,
    )?;
    launch_elems(
        dev,
        stream,
        dtype,
        "attn_naive_bwd_dkv",
        prm.batch * prm.seqlen_k * prm.heads_kv * prm.head_dim,
        &[dk, dv, ws_p.ptr(), ws_ds.ptr(), q, dout],
        prm,
    )
}
