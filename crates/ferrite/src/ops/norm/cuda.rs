//! CUDA host code of the norm family.

use super::{Bwd, BwdOut, Fwd, FwdOut, NormKind, NormOptions, Problem, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, rows, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("norm", "kernels/norm.cu");
const FUNCS: [&str; 5] = [
    "norm_fwd_naive",
    "norm_fwd_vec",
    "norm_bwd_naive",
    "norm_bwd_vec",
    "norm_col_sum",
];
pub fn program(kind: NormKind, dtype: DType, chunks: usize) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_RMS", (kind == NormKind::Rms) as i32)
        .define("FE_CHUNKS", chunks)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for kind in [NormKind::Layer, NormKind::Rms] {
        for d in [DType::F32, DType::F16, DType::BF16] {
            for chunks in [1, 2, rows::MAX_CHUNKS] {
                v.push(KernelSpec {
                    program: program(kind, d, chunks),
                    functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                    min_arch: Arch::SM80,
                });
            }
        }
    }
    v
}

fn ptr(t: Option<&Tensor>) -> Result<u64> {
    t.map_or(Ok(0), |t| t.device_ptr())
}

fn ctx(p: &Problem, stream: &Option<Stream>) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = p.device else {
        unreachable!("norm cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let s = stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

fn block_threads(variant: &str, p: &Problem) -> u32 {
    if variant == "vectorized" {
        rows::threads_vectorized(p.cols, p.dtype)
    } else {
        rows::threads_scalar(p.cols)
    }
}

fn chunks_for(p: &Problem) -> usize {
    rows::chunks(p.cols, p.dtype)
}

pub struct FwdLaunch {
    pub kernel: Kernel,
    pub threads: u32,
}

pub fn plan_fwd(variant: &str, p: &Problem, dev: &Arc<CudaDevice>) -> Result<FwdLaunch> {
    let f = match variant {
        "naive" => "norm_fwd_naive",
        "vectorized" => "norm_fwd_vec",
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CUDA variant named `{other}`"),
            })
        }
    };
    Ok(FwdLaunch {
        kernel: dev.kernel(&program(p.kind, p.dtype, chunks_for(p)), f)?,
        threads: block_threads(variant, p),
    })
}

/// Raw pointers of a forward call (0 = absent).
#[derive(Clone, Copy, Debug, Default)]
pub struct FwdPtrs {
    pub y: u64,
    pub h: u64,
    pub mean: u64,
    pub rstd: u64,
    pub x: u64,
    pub res: u64,
    pub w: u64,
    pub b: u64,
}

pub fn launch_fwd(l: &FwdLaunch, p: &Problem, q: FwdPtrs, eps: f32, stream: &Stream) -> Result<()> {
    let mut a = KernelArgs::new();
    a.push(q.y)
        .push(q.h)
        .push(q.mean)
        .push(q.rstd)
        .push(q.x)
        .push(q.res)
        .push(q.w)
        .push(q.b)
        .push(p.rows as i64)
        .push(p.cols as i64)
        .push(eps);
    l.kernel.launch(
        stream,
        (rows::grid(p.rows), 1, 1),
        (l.threads, 1, 1),
        0,
        &mut a,
    )
}

pub(super) fn forward(
    variant: &str,
    p: &Problem,
    i: &Fwd,
    o: &FwdOut,
    opts: &NormOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let l = plan_fwd(variant, p, &dev)?;
    let q = FwdPtrs {
        y: o.y.device_ptr()?,
        h: ptr(o.h)?,
        mean: ptr(o.mean)?,
        rstd: ptr(o.rstd)?,
        x: i.x.device_ptr()?,
        res: ptr(i.residual)?,
        w: ptr(i.weight)?,
        b: ptr(i.bias)?,
    };
    launch_fwd(&l, p, q, opts.eps, &stream)
}

/// The backward: the dx kernel (writing dw/db partials) and the column sums, with the partials in
/// stream-ordered scratch.
pub struct BwdLaunch {
    pub kernel: Kernel,
    pub col_sum: Kernel,
    pub threads: u32,
    /// Blocks of the dx kernel = partial rows.
    pub grid: u32,
}

pub fn plan_bwd(variant: &str, p: &Problem, dev: &Arc<CudaDevice>) -> Result<BwdLaunch> {
    let prog = program(p.kind, p.dtype, chunks_for(p));
    let (f, grid) = match variant {
        "naive" => ("norm_bwd_naive", rows::grid(p.rows)),
        // A fixed grid (a function of the device only) keeps the reduction order, and so the
        // bits, the same on every run.
        "vectorized" => (
            "norm_bwd_vec",
            (dev.props().sm_count as usize * 2).min(p.rows).max(1) as u32,
        ),
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CUDA variant named `{other}`"),
            })
        }
    };
    Ok(BwdLaunch {
        kernel: dev.kernel(&prog, f)?,
        col_sum: dev.kernel(&prog, "norm_col_sum")?,
        threads: block_threads(variant, p),
        grid,
    })
}

#[derive(Clone, Copy, Debug, Default)]
pub struct BwdPtrs {
    pub dx: u64,
    pub dw: u64,
    pub db: u64,
    pub dy: u64,
    pub x: u64,
    pub w: u64,
    pub mean: u64,
    pub rstd: u64,
}

/// Scratch bytes the backward needs for its partial sums.
pub fn bwd_scratch_bytes(l: &BwdLaunch, p: &Problem, q: &BwdPtrs) -> usize {
    let parts = l.grid as usize * p.cols * 4;
    parts * ((q.dw != 0) as usize + (q.db != 0) as usize)
}

pub fn launch_bwd(
    l: &BwdLaunch,
    p: &Problem,
    q: BwdPtrs,
    scratch: u64,
    stream: &Stream,
) -> Result<()> {
    let part = l.grid as u64 * p.cols as u64 * 4;
    let dw_part = if q.dw != 0 { scratch } else { 0 };
    let db_part = if q.db != 0 {
        scratch + if q.dw != 0 { part } else { 0 }
    } else {
        0
    };
    let mut a = KernelArgs::new();
    a.push(q.dx)
        .push(dw_part)
        .push(db_part)
        .push(q.dy)
        .push(q.x)
        .push(q.w)
        .push(q.mean)
        .push(q.rstd)
        .push(p.rows as i64)
        .push(p.cols as i64);
    l.kernel
        .launch(stream, (l.grid, 1, 1), (l.threads, 1, 1), 0, &mut a)?;
    for (out, part_ptr) in [(q.dw, dw_part), (q.db, db_part)] {
        if out != 0 {
            let mut a = KernelArgs::new();
            a.push(out)
                .push(part_ptr)
                .push(l.grid as i64)
                .push(p.cols as i64);
            l.col_sum.launch(
                stream,
                ((p.cols as u32).div_ceil(256), 1, 1),
                (256, 1, 1),
                0,
                &mut a,
            )?;
        }
    }
    Ok(())
}

pub(super) fn backward(
    variant: &str,
    p: &Problem,
    i: &Bwd,
    o: &BwdOut,
    opts: &NormOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let l = plan_bwd(variant, p, &dev)?;
    let q = BwdPtrs {
        dx: o.dx.device_ptr()?,
        dw: ptr(o.dweight)?,
        db: ptr(o.dbias)?,
        dy: i.dy.device_ptr()?,
        x: i.x.device_ptr()?,
        w: ptr(i.weight)?,
        mean: ptr(i.mean)?,
        rstd: i.rstd.device_ptr()?,
    };
    // Allocated and freed on the op's stream, so it lives exactly as long as the kernels using it.
    let scratch = dev.alloc(bwd_scratch_bytes(&l, p, &q), &stream)?;
    launch_bwd(&l, p, q, scratch.ptr(), &stream)
}
