//! CUDA host code of the norm family.

use super::{Bwd, BwdOut, Fwd, FwdOut, NormKind, NormOptions, Problem, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::rows::{self, RowConfig};
use crate::core::cuda::{device, CudaDevice, Kernel, KernelArgs, Stream};
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
        .define("FE_STAGES", BWD_STAGES)
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

/// How a variant launches: for `vectorized`, the row configuration (tuned at first use).
#[derive(Clone, Copy, Debug)]
pub enum Geometry {
    Naive,
    Vectorized(RowConfig),
}

impl Geometry {
    fn chunks(self) -> usize {
        match self {
            Geometry::Naive => 1,
            Geometry::Vectorized(c) => c.chunks,
        }
    }
    fn threads(self, p: &Problem) -> u32 {
        match self {
            Geometry::Naive => rows::threads_scalar(p.cols),
            Geometry::Vectorized(c) => rows::threads_for(p.cols, p.dtype, c.chunks),
        }
    }
    pub fn describe(self, p: &Problem) -> String {
        match self {
            Geometry::Naive => format!("{} threads/row", self.threads(p)),
            Geometry::Vectorized(c) => format!("{c} ({} threads/row), tuned", self.threads(p)),
        }
    }
}

pub struct FwdLaunch {
    pub kernel: Kernel,
    pub threads: u32,
}

pub fn plan_fwd(g: Geometry, p: &Problem, dev: &Arc<CudaDevice>) -> Result<FwdLaunch> {
    let f = match g {
        Geometry::Naive => "norm_fwd_naive",
        Geometry::Vectorized(_) => "norm_fwd_vec",
    };
    Ok(FwdLaunch {
        kernel: dev.kernel(&program(p.kind, p.dtype, g.chunks()), f)?,
        threads: g.threads(p),
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

fn variant_geometry(variant: &str) -> Result<Option<Geometry>> {
    match variant {
        "naive" => Ok(Some(Geometry::Naive)),
        "vectorized" => Ok(None),
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}

/// The forward geometry of `variant`, tuning the vectorized one on these buffers at first use.
pub fn fwd_geometry(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    q: FwdPtrs,
    eps: f32,
    stream: &Stream,
) -> Result<Geometry> {
    if let Some(g) = variant_geometry(variant)? {
        return Ok(g);
    }
    let key = format!("norm_fwd/{}", p.kind.name());
    let c = rows::tuned(dev, &key, p.rows, p.cols, p.dtype, &[0], |c| {
        let l = plan_fwd(Geometry::Vectorized(*c), p, dev)?;
        rows::time_briefly(dev, stream, || launch_fwd(&l, p, q, eps, stream))
    })?;
    Ok(Geometry::Vectorized(c))
}

pub(super) fn forward(
    variant: &str,
    p: &Problem,
    i: &Fwd,
    o: &FwdOut,
    opts: &NormOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
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
    let g = fwd_geometry(variant, p, &dev, q, opts.eps, &stream)?;
    launch_fwd(&plan_fwd(g, p, &dev)?, p, q, opts.eps, &stream)
}

/// Rows in the vectorized backward's shared-memory ring (the kernel's FE_STAGES).
pub const BWD_STAGES: usize = 3;

/// The backward: the dx kernel (writing dw/db partials) and the column sums, with the partials in
/// stream-ordered scratch.
pub struct BwdLaunch {
    pub kernel: Kernel,
    pub col_sum: Kernel,
    pub threads: u32,
    /// Blocks of the dx kernel = partial rows.
    pub grid: u32,
    /// Dynamic shared memory of the dx kernel (the vectorized ring: stages × (dy, x) rows).
    pub smem: u32,
}

pub fn plan_bwd(g: Geometry, p: &Problem, dev: &Arc<CudaDevice>) -> Result<BwdLaunch> {
    let prog = program(p.kind, p.dtype, g.chunks());
    let f = match g {
        Geometry::Naive => "norm_bwd_naive",
        Geometry::Vectorized(_) => "norm_bwd_vec",
    };
    let kernel = dev.kernel(&prog, f)?;
    let (grid, smem) = match g {
        Geometry::Naive => (rows::grid(p.rows), 0),
        Geometry::Vectorized(c) => {
            let smem = (BWD_STAGES * 2 * p.cols * p.dtype.size_in_bytes()) as u32;
            kernel.allow_dynamic_smem(smem)?;
            // No more blocks per SM than can be resident at once: a grid past that ran its extra
            // blocks as a second, partial wave (LayerNorm bf16 at chunks = 4, 153 registers: 3 fit,
            // so "4 per SM" lost to 2; Nsight Compute on the H100). A fixed grid (a function of
            // the device and the tuned configuration only) keeps the reduction order, and so the
            // bits, the same on every run.
            let resident = kernel.max_active_blocks(g.threads(p), smem)?.max(1);
            let per_sm = c.blocks_per_sm.max(1).min(resident) as usize;
            let grid = (dev.props().sm_count as usize * per_sm).min(p.rows).max(1) as u32;
            (grid, smem)
        }
    };
    Ok(BwdLaunch {
        kernel,
        col_sum: dev.kernel(&prog, "norm_col_sum")?,
        threads: g.threads(p),
        grid,
        smem,
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
    // The dx kernel writes the partial rows with 16-byte stores (rows of cols % VEC == 0 floats).
    if !scratch.is_multiple_of(16) {
        return Err(Error::bad_arg(
            OP,
            "scratch",
            "a 16-byte-aligned device address",
            format!("{scratch:#x}"),
        ));
    }
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
        .launch(stream, (l.grid, 1, 1), (l.threads, 1, 1), l.smem, &mut a)?;
    if q.dw != 0 || q.db != 0 {
        // One launch sums both partial sets (blockIdx.y picks dw or db; a null output is skipped).
        let mut a = KernelArgs::new();
        a.push(q.dw)
            .push(dw_part)
            .push(q.db)
            .push(db_part)
            .push(l.grid as i64)
            .push(p.cols as i64);
        let gx = u32::try_from(p.cols.div_ceil(32))
            .map_err(|_| Error::bad_arg(OP, "x", "fewer than 2³⁷ columns", p.cols))?;
        l.col_sum
            .launch(stream, (gx, 2, 1), (32, 16, 1), 0, &mut a)?;
    }
    Ok(())
}

/// Runs the backward with geometry `g`, scratch allocated and freed on the op's stream (so it
/// lives exactly as long as the kernels using it).
pub fn run_bwd(
    g: Geometry,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    q: BwdPtrs,
    stream: &Stream,
) -> Result<()> {
    let l = plan_bwd(g, p, dev)?;
    let scratch = dev.alloc(bwd_scratch_bytes(&l, p, &q), stream)?;
    launch_bwd(&l, p, q, scratch.ptr(), stream)
}

/// The backward geometry of `variant`, tuning the vectorized one at first use (chunks × grid).
pub fn bwd_geometry(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    q: BwdPtrs,
    stream: &Stream,
) -> Result<Geometry> {
    if let Some(g) = variant_geometry(variant)? {
        return Ok(g);
    }
    // "ring3": the shared-memory-ring kernel that re-reads its stage in the dx pass (fewer
    // registers), its grid capped at the resident blocks; configurations remembered for the
    // kernels it replaced are not reused.
    let key = format!("norm_bwd_ring3/{}", p.kind.name());
    let c = rows::tuned(dev, &key, p.rows, p.cols, p.dtype, &[2, 3, 4, 8], |c| {
        rows::time_briefly(dev, stream, || {
            run_bwd(Geometry::Vectorized(*c), p, dev, q, stream)
        })
    })?;
    Ok(Geometry::Vectorized(c))
}

pub(super) fn backward(
    variant: &str,
    p: &Problem,
    i: &Bwd,
    o: &BwdOut,
    opts: &NormOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
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
    let g = bwd_geometry(variant, p, &dev, q, &stream)?;
    run_bwd(g, p, &dev, q, &stream)
}
