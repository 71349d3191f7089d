//! # norm — LayerNorm and RMSNorm, forward and backward, with the fused residual add
//!
//! Over the last dim of a contiguous `[..., cols]` tensor (rows = everything before it):
//! `h = x + residual` (optional, written out), `y = (h − mean)·rstd·w + b` (LayerNorm) or
//! `y = h·rstd·w` (RMSNorm), `rstd = 1/√(var + eps)`. The forward saves `mean`/`rstd` (fp32, one
//! per row) for the backward, which returns dx and, reduced deterministically (no atomics: the
//! same bits on every run), dw and db.
//!
//! x, residual, y, h, dy, dx share one float dtype (f32, bf16, f16) and shape; w, b, dw, db are
//! `[cols]` of that dtype; mean and rstd are f32 `[rows]`. All arithmetic is fp32.
//!
//! Variants — CPU: `naive` (one thread, three passes) → `parallel` (rows across cores, one pass
//! into a row buffer). CUDA: `naive` (a block per row, three passes over global memory, scalar
//! loads) → `vectorized` (the row in registers after one 16-byte-load read). See kernels/norm.cu.

// The rungs (CPU code, CUDA host code) and the family's check and bench: pub for the harness,
// the CLI and the families that reuse each other's rungs; the API is this module's items.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod cpu;
#[doc(hidden)]
pub mod cuda;

use crate::core::cuda::Stream;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name on the command line and in tables.
pub const OP: &str = "norm";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// LayerNorm: subtract the row mean, divide by the row's standard deviation, then w and b.
    Layer,
    /// RMSNorm: divide by the row's root mean square, then w (no mean, no bias).
    Rms,
}

impl NormKind {
    /// `layer_norm` or `rms_norm`: the op's name in errors.
    pub fn name(self) -> &'static str {
        match self {
            NormKind::Layer => "layer_norm",
            NormKind::Rms => "rms_norm",
        }
    }
}

/// The ladder, in order (the same names for forward and backward).
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread, three passes over each row", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "rows across cores, each row read once into a buffer", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a block per row, three passes over global memory, scalar loads; dw/db via a rows×cols scratch", rank: 1 },
        VariantInfo {
            name: "vectorized",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "cols a multiple of 16 bytes, ≤ 16384 (f32) / 32768 (16-bit), backward ≤ 4096 (f32) / 8192 (16-bit); 16-byte aligned tensors",
            summary: "row in registers after one 16-byte-load pass; backward accumulates dw/db per block in registers",
            rank: 2,
        },
    ]
}

/// Options of one call. `Default`: best variant, eps = 1e-5 (torch's LayerNorm default), the
/// device's own stream.
#[derive(Clone, Debug)]
pub struct NormOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Added to the variance (mean square) before the reciprocal square root; finite and > 0.
    pub eps: f32,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

impl Default for NormOptions {
    fn default() -> Self {
        NormOptions {
            variant: None,
            eps: 1e-5,
            stream: None,
        }
    }
}

/// Forward inputs.
#[derive(Clone, Copy)]
pub struct Fwd<'a> {
    /// The input `[..., cols]`, contiguous.
    pub x: &'a Tensor,
    /// Added to x before the norm (the pre-norm transformer's residual stream).
    pub residual: Option<&'a Tensor>,
    /// The scale `[cols]` (all ones when None).
    pub weight: Option<&'a Tensor>,
    /// The shift `[cols]` (LayerNorm only).
    pub bias: Option<&'a Tensor>,
}

/// Forward outputs (caller-provided). `h` receives x + residual when a residual is given.
#[derive(Clone, Copy)]
pub struct FwdOut<'a> {
    /// The normalised output, x's shape.
    pub y: &'a Tensor,
    /// x + residual, x's shape (only with a residual: what the next residual add and the
    /// backward read).
    pub h: Option<&'a Tensor>,
    /// f32 `[rows]`: each row's mean (LayerNorm), for the backward.
    pub mean: Option<&'a Tensor>,
    /// f32 `[rows]`: each row's 1/√(var + eps), for the backward.
    pub rstd: Option<&'a Tensor>,
}

/// Backward inputs: `x` is the tensor that was normalised (h when the residual was fused).
#[derive(Clone, Copy)]
pub struct Bwd<'a> {
    /// The gradient of y.
    pub dy: &'a Tensor,
    /// The normalised input.
    pub x: &'a Tensor,
    /// The forward's weight.
    pub weight: Option<&'a Tensor>,
    /// The forward's saved means (LayerNorm).
    pub mean: Option<&'a Tensor>,
    /// The forward's saved reciprocal standard deviations.
    pub rstd: &'a Tensor,
}

/// Backward outputs (caller-provided).
#[derive(Clone, Copy)]
pub struct BwdOut<'a> {
    /// The gradient of x (and of the residual, which is the same).
    pub dx: &'a Tensor,
    /// The weight's gradient `[cols]`; only when the forward had a weight.
    pub dweight: Option<&'a Tensor>,
    /// The bias's gradient `[cols]` (LayerNorm).
    pub dbias: Option<&'a Tensor>,
}

/// A validated problem.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Rows: every dim but the last folded.
    pub rows: usize,
    /// The normalised (last) dim.
    pub cols: usize,
    /// The shared dtype.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

impl Problem {
    /// `layer_norm rows×cols`, as the tables show it.
    pub fn label(&self) -> String {
        format!("{} {}×{}", self.kind.name(), self.rows, self.cols)
    }
}

fn expect_like(op: &str, arg: &str, t: &Tensor, like: &Tensor, shape: &[usize]) -> Result<()> {
    if t.device() != like.device()
        || t.dtype() != like.dtype()
        || t.shape() != shape
        || !t.is_contiguous()
    {
        return Err(Error::bad_arg(
            op,
            arg,
            format!(
                "a contiguous {}{shape:?} on {}",
                like.dtype(),
                like.device()
            ),
            describe(t),
        ));
    }
    Ok(())
}

fn expect_stats(op: &str, arg: &str, t: &Tensor, rows: usize, device: Device) -> Result<()> {
    if t.device() != device || t.dtype() != DType::F32 || t.numel() != rows || !t.is_contiguous() {
        return Err(Error::bad_arg(
            op,
            arg,
            format!("a contiguous f32 tensor of {rows} elements (one per row) on {device}"),
            describe(t),
        ));
    }
    Ok(())
}

fn check_distinct(
    op: &str,
    outs: &[(&str, Option<&Tensor>)],
    ins: &[Option<&Tensor>],
) -> Result<()> {
    for (name, o) in outs {
        let Some(o) = o else { continue };
        if ins.iter().flatten().any(|i| o.shares_storage(i)) {
            return Err(Error::bad_arg(
                op,
                *name,
                "a buffer distinct from the inputs",
                "a view of an input",
            ));
        }
    }
    Ok(())
}

/// Shape, dtype and device rules shared by forward and backward.
fn problem(op: &str, kind: NormKind, x: &Tensor, eps: Option<f32>) -> Result<Problem> {
    if x.rank() == 0 || !x.is_contiguous() || !FLOATS.contains(&x.dtype()) {
        return Err(Error::bad_arg(
            op,
            "x",
            "a contiguous f32/f16/bf16 tensor of rank ≥ 1",
            describe(x),
        ));
    }
    let cols = *x.shape().last().unwrap();
    if cols == 0 {
        return Err(Error::bad_arg(
            op,
            "x",
            "a last dim ≥ 1 (the normalised dim)",
            describe(x),
        ));
    }
    if let Some(eps) = eps {
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(Error::bad_arg(op, "eps", "a finite value > 0", eps));
        }
    }
    Ok(Problem {
        kind,
        rows: x.numel() / cols,
        cols,
        dtype: x.dtype(),
        device: x.device(),
    })
}

/// Checks a forward's tensors (shapes, dtypes, devices, contiguity, what `kind` allows, no
/// output aliasing an input) and returns the problem.
pub fn validate_fwd(kind: NormKind, i: &Fwd, o: &FwdOut, eps: f32) -> Result<Problem> {
    let op = kind.name();
    let p = problem(op, kind, i.x, Some(eps))?;
    let shape = i.x.shape();
    expect_like(op, "y", o.y, i.x, shape)?;
    if let Some(r) = i.residual {
        expect_like(op, "residual", r, i.x, shape)?;
    }
    match (i.residual, o.h) {
        (Some(_), Some(h)) => expect_like(op, "h", h, i.x, shape)?,
        (None, Some(h)) => {
            return Err(Error::bad_arg(
                op,
                "h",
                "None when no residual is given",
                describe(h),
            ))
        }
        _ => {}
    }
    for (name, t) in [("weight", i.weight), ("bias", i.bias)] {
        if let Some(t) = t {
            expect_like(op, name, t, i.x, &[p.cols])?;
        }
    }
    if kind == NormKind::Rms {
        if let Some(b) = i.bias {
            return Err(Error::bad_arg(
                op,
                "bias",
                "None (RMSNorm has no bias)",
                describe(b),
            ));
        }
        if let Some(m) = o.mean {
            return Err(Error::bad_arg(
                op,
                "mean",
                "None (RMSNorm has no mean)",
                describe(m),
            ));
        }
    }
    if let Some(m) = o.mean {
        expect_stats(op, "mean", m, p.rows, p.device)?;
    }
    if let Some(r) = o.rstd {
        expect_stats(op, "rstd", r, p.rows, p.device)?;
    }
    check_distinct(
        op,
        &[
            ("y", Some(o.y)),
            ("h", o.h),
            ("mean", o.mean),
            ("rstd", o.rstd),
        ],
        &[Some(i.x), i.residual, i.weight, i.bias],
    )?;
    Ok(p)
}

/// Checks a backward's tensors as [`validate_fwd`] does.
pub fn validate_bwd(kind: NormKind, i: &Bwd, o: &BwdOut) -> Result<Problem> {
    let op = if kind == NormKind::Layer {
        "layer_norm_backward"
    } else {
        "rms_norm_backward"
    };
    let p = problem(op, kind, i.x, None)?;
    let shape = i.x.shape();
    expect_like(op, "dy", i.dy, i.x, shape)?;
    expect_like(op, "dx", o.dx, i.x, shape)?;
    expect_stats(op, "rstd", i.rstd, p.rows, p.device)?;
    match (kind, i.mean) {
        (NormKind::Layer, Some(m)) => expect_stats(op, "mean", m, p.rows, p.device)?,
        (NormKind::Layer, None) => {
            return Err(Error::bad_arg(
                op,
                "mean",
                "the mean saved by the forward pass",
                "None",
            ))
        }
        (NormKind::Rms, Some(m)) => {
            return Err(Error::bad_arg(
                op,
                "mean",
                "None (RMSNorm has no mean)",
                describe(m),
            ))
        }
        (NormKind::Rms, None) => {}
    }
    for (name, t) in [
        ("weight", i.weight),
        ("dweight", o.dweight),
        ("dbias", o.dbias),
    ] {
        if let Some(t) = t {
            expect_like(op, name, t, i.x, &[p.cols])?;
        }
    }
    if o.dweight.is_some() && i.weight.is_none() {
        return Err(Error::bad_arg(
            op,
            "dweight",
            "None when the forward had no weight",
            "a tensor",
        ));
    }
    if kind == NormKind::Rms && o.dbias.is_some() {
        return Err(Error::bad_arg(
            op,
            "dbias",
            "None (RMSNorm has no bias)",
            "a tensor",
        ));
    }
    check_distinct(
        op,
        &[
            ("dx", Some(o.dx)),
            ("dweight", o.dweight),
            ("dbias", o.dbias),
        ],
        &[Some(i.dy), Some(i.x), i.weight, i.mean, Some(i.rstd)],
    )?;
    Ok(p)
}

/// Widest row the vectorized backward takes: it keeps five fp32 arrays of the row (and the next
/// row's raw vectors) in registers, and beyond this a block no longer fits the SM's 64K registers.
pub fn vectorized_bwd_max_cols(dtype: DType) -> usize {
    if dtype == DType::F32 {
        4096
    } else {
        8192
    }
}

/// Whether the `vectorized` CUDA variant can take this problem, or why not.
pub fn vectorized_fits(p: &Problem, ptrs: &[u64]) -> Option<String> {
    crate::core::cuda::rows::vectorized_unfit(p.cols, p.dtype, ptrs)
}

/// The same for the backward pass.
pub fn vectorized_bwd_fits(p: &Problem, ptrs: &[u64]) -> Option<String> {
    let max = vectorized_bwd_max_cols(p.dtype);
    if p.cols > max {
        return Some(format!(
            "backward needs cols ≤ {max} for {} (got {})",
            p.dtype, p.cols
        ));
    }
    vectorized_fits(p, ptrs)
}

fn select(
    p: &Problem,
    requested: Option<&str>,
    ptrs: &[u64],
    backward: bool,
) -> Result<VariantInfo> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        p.kind.name(),
        &vs,
        requested,
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda && v.name == "vectorized")
                .then(|| {
                    if backward {
                        vectorized_bwd_fits(p, ptrs)
                    } else {
                        vectorized_fits(p, ptrs)
                    }
                })
                .flatten()
        },
    )?;
    Ok(v.clone())
}

fn device_ptrs(ts: &[Option<&Tensor>]) -> Result<Vec<u64>> {
    ts.iter().flatten().map(|t| t.device_ptr()).collect()
}

/// Forward into caller-provided outputs.
pub fn forward_into(kind: NormKind, i: &Fwd, o: &FwdOut, opts: &NormOptions) -> Result<()> {
    let p = validate_fwd(kind, i, o, opts.eps)?;
    let ptrs = if p.device.is_cuda() {
        device_ptrs(&[Some(i.x), i.residual, i.weight, i.bias, Some(o.y), o.h])?
    } else {
        vec![]
    };
    let v = select(&p, opts.variant.as_deref(), &ptrs, false)?;
    match p.device {
        Device::Cpu => cpu::forward(v.name, &p, i, o, opts.eps),
        Device::Cuda(_) => cuda::forward(v.name, &p, i, o, opts),
    }
}

/// Backward into caller-provided outputs.
pub fn backward_into(kind: NormKind, i: &Bwd, o: &BwdOut, opts: &NormOptions) -> Result<()> {
    let p = validate_bwd(kind, i, o)?;
    let ptrs = if p.device.is_cuda() {
        device_ptrs(&[Some(i.dy), Some(i.x), i.weight, Some(o.dx)])?
    } else {
        vec![]
    };
    let v = select(&p, opts.variant.as_deref(), &ptrs, true)?;
    match p.device {
        Device::Cpu => cpu::backward(v.name, &p, i, o),
        Device::Cuda(_) => cuda::backward(v.name, &p, i, o, opts),
    }
}

/// RMSNorm over the last dim: returns (y, rstd).
///
/// ```rust
/// use ferrite::Tensor;
/// let x = Tensor::from_vec(vec![3.0f32, 4.0, -3.0, -4.0], &[2, 2])?;
/// let (y, rstd) = ferrite::ops::norm::rms_norm(&x, None, 1e-6)?;
/// let y = y.to_vec::<f32>()?; // each row's root mean square is √12.5
/// let rms = 12.5f32.sqrt();
/// assert!((y[0] - 3.0 / rms).abs() < 1e-5 && (y[3] + 4.0 / rms).abs() < 1e-5);
/// assert_eq!(rstd.shape(), &[2]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)> {
    let p = problem("rms_norm", NormKind::Rms, x, Some(eps))?;
    let y = Tensor::empty(x.shape(), x.dtype(), x.device())?;
    let rstd = Tensor::empty(&[p.rows], DType::F32, x.device())?;
    let opts = NormOptions {
        eps,
        ..Default::default()
    };
    forward_into(
        NormKind::Rms,
        &Fwd {
            x,
            residual: None,
            weight,
            bias: None,
        },
        &FwdOut {
            y: &y,
            h: None,
            mean: None,
            rstd: Some(&rstd),
        },
        &opts,
    )?;
    Ok((y, rstd))
}

/// LayerNorm over the last dim: returns (y, mean, rstd).
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let p = problem("layer_norm", NormKind::Layer, x, Some(eps))?;
    let y = Tensor::empty(x.shape(), x.dtype(), x.device())?;
    let mean = Tensor::empty(&[p.rows], DType::F32, x.device())?;
    let rstd = Tensor::empty(&[p.rows], DType::F32, x.device())?;
    let opts = NormOptions {
        eps,
        ..Default::default()
    };
    forward_into(
        NormKind::Layer,
        &Fwd {
            x,
            residual: None,
            weight,
            bias,
        },
        &FwdOut {
            y: &y,
            h: None,
            mean: Some(&mean),
            rstd: Some(&rstd),
        },
        &opts,
    )?;
    Ok((y, mean, rstd))
}

/// The family as the harness sees it.
pub struct Norm;

impl OpFamily for Norm {
    fn name(&self) -> &'static str {
        OP
    }
    fn variants(&self) -> Vec<VariantInfo> {
        variants()
    }
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
        check::run(cfg, out)
    }
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()> {
        bench::run(cfg, ceilings, progress, out)
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
