//! # softmax — y = softmax(scale·x) over the last dim, and its backward
//!
//! x, y, dy, dx: one float dtype (f32, bf16, f16), contiguous `[..., cols]`; fp32 arithmetic.
//! Backward: dx = scale · y ⊙ (dy − Σ dy⊙y) from the saved output y (x is not needed).
//!
//! Variants — CPU: `naive` (one thread) → `parallel` (rows across cores). CUDA: `naive` (a block
//! per row, three passes over global memory) → `vectorized` (the row in registers after one
//! 16-byte-load read). See kernels/softmax.cu.

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

use crate::core::cuda::{rows, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "softmax";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread, three passes per row", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "rows across cores", rank: 2 },
        VariantInfo { name: "simd", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "parallel, with the exponentials vectorised (Cody-Waite + degree-7 polynomial, 16 lanes with AVX-512) instead of libm's scalar expf", rank: 3 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a block per row, three passes over global memory, scalar loads", rank: 1 },
        VariantInfo {
            name: "vectorized",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "cols a multiple of 16 bytes, ≤ 16384 (f32) / 32768 (16-bit), backward ≤ 16384; 16-byte aligned tensors",
            summary: "the row in registers after one 16-byte-load read: one read, one write",
            rank: 2,
        },
    ]
}

/// Options of one call. `Default`: best variant, scale 1, the device's own stream.
#[derive(Clone, Debug)]
pub struct SoftmaxOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Multiplies x before the softmax (attention's 1/√d).
    pub scale: f32,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

impl Default for SoftmaxOptions {
    fn default() -> Self {
        SoftmaxOptions {
            variant: None,
            scale: 1.0,
            stream: None,
        }
    }
}

/// A validated problem.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// Rows: every dim but the last folded.
    pub rows: usize,
    /// The softmax (last) dim.
    pub cols: usize,
    /// The shared dtype.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

fn validate(
    op: &str,
    ins: &[(&str, &Tensor)],
    outs: &[(&str, &Tensor)],
    scale: f32,
) -> Result<Problem> {
    let x = ins[0].1;
    if x.rank() == 0
        || !x.is_contiguous()
        || !FLOATS.contains(&x.dtype())
        || x.shape().last() == Some(&0)
    {
        return Err(Error::bad_arg(
            op,
            ins[0].0,
            "a contiguous f32/f16/bf16 tensor of rank ≥ 1 with a last dim ≥ 1",
            describe(x),
        ));
    }
    if !scale.is_finite() {
        return Err(Error::bad_arg(op, "scale", "a finite number", scale));
    }
    for (name, t) in ins.iter().chain(outs).skip(1) {
        if t.device() != x.device()
            || t.dtype() != x.dtype()
            || t.shape() != x.shape()
            || !t.is_contiguous()
        {
            return Err(Error::bad_arg(
                op,
                *name,
                format!("a contiguous tensor like `{}` ({})", ins[0].0, describe(x)),
                describe(t),
            ));
        }
    }
    for (name, o) in outs {
        if ins.iter().any(|(_, i)| o.shares_storage(i)) {
            return Err(Error::bad_arg(
                op,
                *name,
                "a buffer distinct from the inputs",
                "a view of an input",
            ));
        }
    }
    let cols = *x.shape().last().unwrap();
    Ok(Problem {
        rows: x.numel() / cols,
        cols,
        dtype: x.dtype(),
        device: x.device(),
    })
}

/// Widest row the vectorized backward takes (dy and y both held in registers; wider blocks no
/// longer fit the SM's 64K registers).
pub const VECTORIZED_BWD_MAX_COLS: usize = 16384;

/// Why the vectorized kernel cannot take this problem (forward or backward), if so.
pub fn vectorized_unfit(p: &Problem, ptrs: &[u64], backward: bool) -> Option<String> {
    if backward && p.cols > VECTORIZED_BWD_MAX_COLS {
        return Some(format!(
            "backward needs cols ≤ {VECTORIZED_BWD_MAX_COLS} (got {})",
            p.cols
        ));
    }
    rows::vectorized_unfit(p.cols, p.dtype, ptrs)
}

fn select(
    p: &Problem,
    requested: Option<&str>,
    ptrs: &[u64],
    backward: bool,
) -> Result<&'static str> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        OP,
        &vs,
        requested,
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda && v.name == "vectorized")
                .then(|| vectorized_unfit(p, ptrs, backward))
                .flatten()
        },
    )?;
    Ok(v.name)
}

fn ptrs(p: &Problem, ts: &[&Tensor]) -> Result<Vec<u64>> {
    if p.device.is_cuda() {
        ts.iter().map(|t| t.device_ptr()).collect()
    } else {
        Ok(vec![])
    }
}

/// y = softmax(scale·x) into a caller-provided y.
pub fn softmax_into(x: &Tensor, y: &Tensor, opts: &SoftmaxOptions) -> Result<()> {
    let p = validate(OP, &[("x", x)], &[("y", y)], opts.scale)?;
    let v = select(&p, opts.variant.as_deref(), &ptrs(&p, &[x, y])?, false)?;
    match p.device {
        Device::Cpu => cpu::forward(v, &p, x, y, opts.scale),
        Device::Cuda(_) => cuda::forward(v, &p, x, y, opts),
    }
}

/// dx = scale · y ⊙ (dy − Σ dy⊙y) into a caller-provided dx.
pub fn softmax_backward_into(
    dy: &Tensor,
    y: &Tensor,
    dx: &Tensor,
    opts: &SoftmaxOptions,
) -> Result<()> {
    let p = validate(
        "softmax_backward",
        &[("dy", dy), ("y", y)],
        &[("dx", dx)],
        opts.scale,
    )?;
    let v = select(&p, opts.variant.as_deref(), &ptrs(&p, &[dy, y, dx])?, true)?;
    match p.device {
        Device::Cpu => cpu::backward(v, &p, dy, y, dx, opts.scale),
        Device::Cuda(_) => cuda::backward(v, &p, dy, y, dx, opts),
    }
}

/// softmax(scale·x) over the last dim into a new tensor, with the best variant.
///
/// ```rust
/// use ferrite::Tensor;
/// let x = Tensor::from_vec(vec![0.0f32, 0.0, 1.0, 1.0], &[2, 2])?;
/// assert_eq!(ferrite::ops::softmax::softmax(&x, 1.0)?.to_vec::<f32>()?, vec![0.5; 4]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn softmax(x: &Tensor, scale: f32) -> Result<Tensor> {
    let y = Tensor::empty(x.shape(), x.dtype(), x.device())?;
    softmax_into(
        x,
        &y,
        &SoftmaxOptions {
            scale,
            ..Default::default()
        },
    )?;
    Ok(y)
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Softmax;

impl OpFamily for Softmax {
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
