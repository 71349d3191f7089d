//! CUDA host code of the activation family: the unfused `naive` chain and the one-pass `fused`
//! kernels, for bias+act+dropout and the GLU.

use super::{ActOptions, Activation, Dropout, GluOptions, Problem, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, rows, CudaDevice, DeviceBuffer, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("activation", "kernels/activation.cu");
const FUNCS: [&str; 19] = [
    "act_bias_add_naive",
    "act_apply_naive",
    "act_grad_naive",
    "act_mul_naive",
    "act_dropout_naive",
    "act_col_sum_naive",
    "act_col_sum",
    "act_fwd_fused_u1",
    "act_fwd_fused_u2",
    "act_fwd_fused_u4",
    "act_bwd_fused_u1",
    "act_bwd_fused_u2",
    "act_bwd_fused_u4",
    "glu_fwd_fused_u1",
    "glu_fwd_fused_u2",
    "glu_fwd_fused_u4",
    "glu_bwd_fused_u1",
    "glu_bwd_fused_u2",
    "glu_bwd_fused_u4",
];

/// Rows a fused thread loads before computing (the kernels' UNROLL): each compiled as an entry
/// `<kernel>_u<U>`, the fastest timed at first use per (device, kernel, dtype, act, shape class).
pub const UNROLLS: [usize; 3] = [1, 2, 4];
/// Threads per block of the scalar (naive) kernels.
const SCALAR_THREADS: u32 = 256;
/// Most threads per block of the fused kernels.
const FUSED_THREADS: usize = 256;

pub fn program(dtype: DType, act: Activation) -> Program {
    Program::new(SRC)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_ACT", act.code())
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for act in Activation::ALL {
        for d in [DType::F32, DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: program(d, act),
                functions: FUNCS.iter().map(|s| s.to_string()).collect(),
                min_arch: Arch::SM80,
            });
        }
    }
    v
}

fn kernel(dev: &Arc<CudaDevice>, p: &Problem, f: &str) -> Result<Kernel> {
    dev.kernel(&program(p.dtype, p.act), f)
}

/// Grid of a grid-stride scalar kernel over `total` elements.
fn scalar_grid(dev: &CudaDevice, total: usize) -> u32 {
    let most = dev.props().sm_count as usize * 32;
    total.div_ceil(SCALAR_THREADS as usize).clamp(1, most) as u32
}

/// Launch shape of a fused kernel: x over 16-byte column vectors, y over row groups.
#[derive(Clone, Copy, Debug)]
pub struct FusedGeom {
    pub threads: u32,
    pub grid: (u32, u32, u32),
}

impl FusedGeom {
    pub fn describe(&self) -> String {
        format!(
            "{} threads × grid {}×{}",
            self.threads, self.grid.0, self.grid.1
        )
    }
}

/// Blocks of `k` resident per SM at `threads` threads (from the driver's occupancy calculator).
pub fn blocks_per_sm(dev: &CudaDevice, k: &Kernel, threads: u32) -> Result<usize> {
    let occ = k.occupancy(threads, 0)?;
    let per_sm = occ * dev.props().max_threads_per_sm as f64 / threads as f64;
    Ok((per_sm.round() as usize).max(1))
}

/// The forward takes one block row per `unroll` rows (the kernel loops beyond 65535); the backward
/// (`resident_per_sm` = Some(blocks of the kernel an SM holds)) a fixed grid of one resident wave,
/// so the db partials are few (gy × cols fp32) and their order depends only on the device, the
/// kernel build and the shape (deterministic).
pub fn fused_geom(
    dev: &CudaDevice,
    p: &Problem,
    unroll: usize,
    resident_per_sm: Option<usize>,
) -> Result<FusedGeom> {
    let nvec = p.cols / rows::vec_width(p.dtype);
    let threads = (nvec.min(FUSED_THREADS).div_ceil(32) * 32).max(32);
    let gx = nvec.div_ceil(threads);
    let gx = u32::try_from(gx)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| Error::bad_arg(OP, "x", "a last dim below 2³¹ vectors", p.cols))?;
    let gy = match resident_per_sm {
        Some(b) => (dev.props().sm_count as usize * b)
            .div_ceil(gx as usize)
            .min(p.rows),
        None => p.rows.div_ceil(unroll),
    };
    Ok(FusedGeom {
        threads: threads as u32,
        grid: (gx, gy.clamp(1, 65535) as u32, 1),
    })
}

/// The fused kernels, for tuning keys and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    ActFwd,
    ActBwd,
    GluFwd,
    GluBwd,
}

impl Fused {
    pub fn name(self) -> &'static str {
        match self {
            Fused::ActFwd => "act_fwd_fused",
            Fused::ActBwd => "act_bwd_fused",
            Fused::GluFwd => "glu_fwd_fused",
            Fused::GluBwd => "glu_bwd_fused",
        }
    }
}

/// Revision of the fused kernels in the tuning key: bumped when their instruction mix changes
/// (r2: 16-bit dropout draws, the sigmoid on the SFU), so unrolls remembered in `tune.json` for
/// the old kernels are measured again.
const TUNE_REV: &str = "r2";

/// `dropout`: whether the kernel draws a mask (a different instruction mix, tuned apart).
fn tune_key(dev: &CudaDevice, p: &Problem, f: Fused, dropout: bool) -> String {
    format!(
        "{}/{}.{TUNE_REV}{}/{}/{}/rows~{}/cols={}",
        dev.props().name,
        f.name(),
        if dropout { "+dropout" } else { "" },
        p.dtype,
        p.act.name(),
        crate::core::tune::shape_class(&[p.rows]),
        p.cols
    )
}

/// The unroll of fused kernel `f` for this problem: remembered, or timed now with `run` (on the
/// caller's buffers; the kernels are idempotent, so re-running them is harmless).
fn tuned_unroll(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    f: Fused,
    dropout: bool,
    stream: &Stream,
    run: &dyn Fn(usize) -> Result<()>,
) -> Result<usize> {
    crate::core::tune::pick(&tune_key(dev, p, f, dropout), &UNROLLS, |&u| {
        rows::time_briefly(dev, stream, || run(u))
    })
    .map(|(u, _)| u)
}

/// The backward kernel with unroll `u` and its fixed grid (one resident wave).
fn bwd_plan(dev: &Arc<CudaDevice>, p: &Problem, u: usize) -> Result<(Kernel, FusedGeom)> {
    let k = kernel(dev, p, &format!("act_bwd_fused_u{u}"))?;
    let threads = fused_geom(dev, p, u, None)?.threads;
    let g = fused_geom(dev, p, u, Some(blocks_per_sm(dev, &k, threads)?))?;
    Ok((k, g))
}

/// For reports: the kernel, launch shape and unroll the fused path uses for `f` — the tuned
/// choice if one is remembered (None before the first run).
pub fn fused_choice(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    f: Fused,
    dropout: bool,
) -> Result<Option<(Kernel, FusedGeom, usize)>> {
    let Some(u) = crate::core::tune::remembered(&tune_key(dev, p, f, dropout), &UNROLLS) else {
        return Ok(None);
    };
    let (k, g) = if f == Fused::ActBwd {
        bwd_plan(dev, p, u)?
    } else {
        (
            kernel(dev, p, &format!("{}_u{u}", f.name()))?,
            fused_geom(dev, p, u, None)?,
        )
    };
    Ok(Some((k, g, u)))
}

fn dropout_args(a: &mut KernelArgs, d: &Dropout) {
    let (thr, scale, on) = match d.params() {
        Some((t, s)) => (t, s, 1i32),
        None => (0u32, 1.0f32, 0i32),
    };
    a.push(d.seed).push(d.offset).push(thr).push(scale).push(on);
}

fn launch_scalar(
    dev: &CudaDevice,
    k: &Kernel,
    total: usize,
    a: &mut KernelArgs,
    stream: &Stream,
) -> Result<()> {
    k.launch(
        stream,
        (scalar_grid(dev, total), 1, 1),
        (SCALAR_THREADS, 1, 1),
        0,
        a,
    )
}

fn temp(dev: &Arc<CudaDevice>, p: &Problem, elems: usize, stream: &Stream) -> Result<DeviceBuffer> {
    dev.alloc(elems * p.dtype.size_in_bytes(), stream)
}

/// out[r, j] = act(in[r, j]) (strided rows).
#[allow(clippy::too_many_arguments)]
fn apply(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    out: (u64, usize),
    inp: (u64, usize),
    rows: usize,
    n: usize,
    stream: &Stream,
) -> Result<()> {
    let mut a = KernelArgs::new();
    a.push(out.0)
        .push(out.1 as i64)
        .push(inp.0)
        .push(inp.1 as i64)
        .push(rows as i64)
        .push(n as i64);
    launch_scalar(
        dev,
        &kernel(dev, p, "act_apply_naive")?,
        rows * n,
        &mut a,
        stream,
    )
}

/// out[r, j] = a[r, j] · b[r, j] (`f` = act_mul_naive) or a · act'(b) (`f` = act_grad_naive).
#[allow(clippy::too_many_arguments)]
fn binary(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    f: &str,
    out: (u64, usize),
    x: (u64, usize),
    y: (u64, usize),
    rows: usize,
    n: usize,
    stream: &Stream,
) -> Result<()> {
    let mut a = KernelArgs::new();
    a.push(out.0)
        .push(out.1 as i64)
        .push(x.0)
        .push(x.1 as i64)
        .push(y.0)
        .push(y.1 as i64)
        .push(rows as i64)
        .push(n as i64);
    launch_scalar(dev, &kernel(dev, p, f)?, rows * n, &mut a, stream)
}

fn dropout_naive(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    out: u64,
    inp: u64,
    d: &Dropout,
    stream: &Stream,
) -> Result<()> {
    let (thr, scale) = d.params().expect("dropout_naive with p = 0");
    let n = p.rows * p.cols;
    let mut a = KernelArgs::new();
    a.push(out)
        .push(inp)
        .push(n as i64)
        .push(d.seed)
        .push(d.offset)
        .push(thr)
        .push(scale);
    launch_scalar(
        dev,
        &kernel(dev, p, "act_dropout_naive")?,
        n,
        &mut a,
        stream,
    )
}

/// h = x + b into a temporary, or x itself without a bias.
fn bias_add(
    dev: &Arc<CudaDevice>,
    p: &Problem,
    x: u64,
    b: u64,
    stream: &Stream,
) -> Result<(u64, Option<DeviceBuffer>)> {
    if b == 0 {
        return Ok((x, None));
    }
    let h = temp(dev, p, p.rows * p.cols, stream)?;
    let mut a = KernelArgs::new();
    a.push(h.ptr())
        .push(x)
        .push(b)
        .push(p.rows as i64)
        .push(p.cols as i64);
    launch_scalar(
        dev,
        &kernel(dev, p, "act_bias_add_naive")?,
        p.rows * p.cols,
        &mut a,
        stream,
    )?;
    Ok((h.ptr(), Some(h)))
}

/// Raw pointers of a bias+act+dropout call (0 = absent). Forward: `out` = y, `g` unused;
/// backward: `out` = dx, `g` = dy.
#[derive(Clone, Copy, Debug, Default)]
pub struct ActPtrs {
    pub out: u64,
    pub db: u64,
    pub g: u64,
    pub x: u64,
    pub b: u64,
}

/// The forward of `variant` on raw pointers (what the bench times).
pub fn run_act_fwd(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    q: ActPtrs,
    d: &Dropout,
    stream: &Stream,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    match variant {
        "naive" => {
            let c = p.cols;
            let (h, _h_buf) = bias_add(dev, p, q.x, q.b, stream)?;
            let a_buf = match d.params() {
                Some(_) => Some(temp(dev, p, p.rows * c, stream)?),
                None => None,
            };
            let a = a_buf.as_ref().map_or(q.out, |b| b.ptr());
            apply(dev, p, (a, c), (h, c), p.rows, c, stream)?;
            if a_buf.is_some() {
                dropout_naive(dev, p, q.out, a, d, stream)?;
            }
            Ok(())
        }
        "fused" => {
            let run = |u: usize| -> Result<()> {
                let g = fused_geom(dev, p, u, None)?;
                let mut a = KernelArgs::new();
                a.push(q.out)
                    .push(q.x)
                    .push(q.b)
                    .push(p.rows as i64)
                    .push(p.cols as i64);
                dropout_args(&mut a, d);
                kernel(dev, p, &format!("act_fwd_fused_u{u}"))?.launch(
                    stream,
                    g.grid,
                    (g.threads, 1, 1),
                    0,
                    &mut a,
                )
            };
            run(tuned_unroll(
                dev,
                p,
                Fused::ActFwd,
                d.params().is_some(),
                stream,
                &run,
            )?)
        }
        other => no_variant(other),
    }
}

/// The backward of `variant` on raw pointers; scratch (temporaries, db partials) is allocated
/// and freed on `stream`, so it lives exactly as long as the kernels using it.
pub fn run_act_bwd(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    q: ActPtrs,
    d: &Dropout,
    stream: &Stream,
) -> Result<()> {
    if p.rows == 0 {
        if q.db != 0 {
            // SAFETY: db is a live [cols] tensor of this device (validated by the caller).
            unsafe { dev.memset(q.db, 0, p.cols * p.dtype.size_in_bytes(), stream)? };
        }
        return Ok(());
    }
    let c = p.cols;
    match variant {
        "naive" => {
            let (h, _h_buf) = bias_add(dev, p, q.x, q.b, stream)?;
            let g_buf = match d.params() {
                Some(_) => {
                    let t = temp(dev, p, p.rows * c, stream)?;
                    dropout_naive(dev, p, t.ptr(), q.g, d, stream)?;
                    Some(t)
                }
                None => None,
            };
            let g = g_buf.as_ref().map_or(q.g, |b| b.ptr());
            binary(
                dev,
                p,
                "act_grad_naive",
                (q.out, c),
                (g, c),
                (h, c),
                p.rows,
                c,
                stream,
            )?;
            if q.db != 0 {
                let mut a = KernelArgs::new();
                a.push(q.db).push(q.out).push(p.rows as i64).push(c as i64);
                kernel(dev, p, "act_col_sum_naive")?.launch(
                    stream,
                    (c.div_ceil(256) as u32, 1, 1),
                    (256, 1, 1),
                    0,
                    &mut a,
                )?;
            }
            Ok(())
        }
        "fused" => {
            let run = |u: usize| -> Result<()> {
                let (k, g) = bwd_plan(dev, p, u)?;
                let parts = g.grid.1 as usize;
                let scratch = if q.db != 0 {
                    Some(dev.alloc(parts * c * 4, stream)?)
                } else {
                    None
                };
                let part = scratch.as_ref().map_or(0, |s| s.ptr());
                let mut a = KernelArgs::new();
                a.push(q.out)
                    .push(part)
                    .push(q.g)
                    .push(q.x)
                    .push(q.b)
                    .push(p.rows as i64)
                    .push(c as i64);
                dropout_args(&mut a, d);
                k.launch(stream, g.grid, (g.threads, 1, 1), 0, &mut a)?;
                if q.db != 0 {
                    let mut a = KernelArgs::new();
                    a.push(q.db).push(part).push(parts as i64).push(c as i64);
                    kernel(dev, p, "act_col_sum")?.launch(
                        stream,
                        (c.div_ceil(32) as u32, 1, 1),
                        (32, 16, 1),
                        0,
                        &mut a,
                    )?;
                }
                Ok(())
            };
            run(tuned_unroll(
                dev,
                p,
                Fused::ActBwd,
                d.params().is_some(),
                stream,
                &run,
            )?)
        }
        other => no_variant(other),
    }
}

/// GLU forward: `out` [rows, n] from `inp` [rows, 2n].
pub fn run_glu_fwd(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    out: u64,
    inp: u64,
    stream: &Stream,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let (n, es) = (p.cols, p.dtype.size_in_bytes() as u64);
    let up = inp + n as u64 * es;
    match variant {
        "naive" => {
            let a = temp(dev, p, p.rows * n, stream)?;
            apply(dev, p, (a.ptr(), n), (inp, 2 * n), p.rows, n, stream)?;
            binary(
                dev,
                p,
                "act_mul_naive",
                (out, n),
                (a.ptr(), n),
                (up, 2 * n),
                p.rows,
                n,
                stream,
            )
        }
        "fused" => {
            let run = |u: usize| -> Result<()> {
                let g = fused_geom(dev, p, u, None)?;
                let mut a = KernelArgs::new();
                a.push(out).push(inp).push(p.rows as i64).push(n as i64);
                kernel(dev, p, &format!("glu_fwd_fused_u{u}"))?.launch(
                    stream,
                    g.grid,
                    (g.threads, 1, 1),
                    0,
                    &mut a,
                )
            };
            run(tuned_unroll(dev, p, Fused::GluFwd, false, stream, &run)?)
        }
        other => no_variant(other),
    }
}

/// GLU backward: `din` [rows, 2n] from `dout` [rows, n] and `inp` [rows, 2n].
pub fn run_glu_bwd(
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    din: u64,
    dout: u64,
    inp: u64,
    stream: &Stream,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let (n, es) = (p.cols, p.dtype.size_in_bytes() as u64);
    let (up, dup) = (inp + n as u64 * es, din + n as u64 * es);
    match variant {
        "naive" => {
            // As autograd runs it: recompute act(gate), d(up) = dout·act(gate),
            // t = dout·up, d(gate) = t·act'(gate).
            let r = p.rows;
            let a = temp(dev, p, r * n, stream)?;
            apply(dev, p, (a.ptr(), n), (inp, 2 * n), r, n, stream)?;
            binary(
                dev,
                p,
                "act_mul_naive",
                (dup, 2 * n),
                (dout, n),
                (a.ptr(), n),
                r,
                n,
                stream,
            )?;
            let t = temp(dev, p, r * n, stream)?;
            binary(
                dev,
                p,
                "act_mul_naive",
                (t.ptr(), n),
                (dout, n),
                (up, 2 * n),
                r,
                n,
                stream,
            )?;
            binary(
                dev,
                p,
                "act_grad_naive",
                (din, 2 * n),
                (t.ptr(), n),
                (inp, 2 * n),
                r,
                n,
                stream,
            )
        }
        "fused" => {
            let run = |u: usize| -> Result<()> {
                let g = fused_geom(dev, p, u, None)?;
                let mut a = KernelArgs::new();
                a.push(din)
                    .push(dout)
                    .push(inp)
                    .push(p.rows as i64)
                    .push(n as i64);
                kernel(dev, p, &format!("glu_bwd_fused_u{u}"))?.launch(
                    stream,
                    g.grid,
                    (g.threads, 1, 1),
                    0,
                    &mut a,
                )
            };
            run(tuned_unroll(dev, p, Fused::GluBwd, false, stream, &run)?)
        }
        other => no_variant(other),
    }
}

fn no_variant(name: &str) -> Result<()> {
    Err(Error::NoVariant {
        op: OP.into(),
        msg: format!("no CUDA variant named `{name}`"),
    })
}

fn ctx(p: &Problem, stream: &Option<Stream>) -> Result<(Arc<CudaDevice>, Stream)> {
    let Device::Cuda(i) = p.device else {
        unreachable!("activation cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let s = stream.clone().unwrap_or_else(|| dev.stream().clone());
    Ok((dev, s))
}

fn ptr(t: Option<&Tensor>) -> Result<u64> {
    t.map_or(Ok(0), |t| t.device_ptr())
}

pub(super) fn act_forward(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    bias: Option<&Tensor>,
    y: &Tensor,
    opts: &ActOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let q = ActPtrs {
        out: y.device_ptr()?,
        db: 0,
        g: 0,
        x: x.device_ptr()?,
        b: ptr(bias)?,
    };
    run_act_fwd(variant, p, &dev, q, &opts.dropout, &stream)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn act_backward(
    variant: &str,
    p: &Problem,
    dy: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    dx: &Tensor,
    dbias: Option<&Tensor>,
    opts: &ActOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    let q = ActPtrs {
        out: dx.device_ptr()?,
        db: ptr(dbias)?,
        g: dy.device_ptr()?,
        x: x.device_ptr()?,
        b: ptr(bias)?,
    };
    run_act_bwd(variant, p, &dev, q, &opts.dropout, &stream)
}

pub(super) fn glu_forward(
    variant: &str,
    p: &Problem,
    input: &Tensor,
    out: &Tensor,
    opts: &GluOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    run_glu_fwd(
        variant,
        p,
        &dev,
        out.device_ptr()?,
        input.device_ptr()?,
        &stream,
    )
}

pub(super) fn glu_backward(
    variant: &str,
    p: &Problem,
    dout: &Tensor,
    input: &Tensor,
    dinput: &Tensor,
    opts: &GluOptions,
) -> Result<()> {
    let (dev, stream) = ctx(p, &opts.stream)?;
    run_glu_bwd(
        variant,
        p,
        &dev,
        dinput.device_ptr()?,
        dout.device_ptr()?,
        input.device_ptr()?,
        &stream,
    )
}
