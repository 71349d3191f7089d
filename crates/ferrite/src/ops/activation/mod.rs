//! # activation — bias + activation + dropout, and the gated linear units (SwiGLU, GEGLU)
//!
//! **bias_act_dropout**: `y = dropout(act(x + b))` over a contiguous `[..., n]` tensor, `b` `[n]`
//! optional, `act` ∈ none / relu / gelu_tanh / gelu_erf / silu, dropout probability `p` ∈ [0, 1)
//! (p = 0: no RNG, no mask), kept values scaled by 1/(1 − p). The mask is Philox4x32-10
//! (`core::philox`) addressed by the caller's `(seed, offset)`: element `i` (row-major over the
//! whole tensor) takes the 16-bit half `i % 2` (low first) of word `(i/2) % 4` of the block at
//! counter `offset + i/8` (`philox::draw`), kept when that draw is `< ⌊(1 − p)·2¹⁶⌋` (an integer
//! compare; one block per 8 elements). The same bits on the CPU and the GPU, so the backward
//! redraws the mask instead of storing it; a call consumes `core::philox::blocks_used(numel)`
//! counters, so the next call passes `offset + blocks_used(numel)`.
//! Backward: `dx = dy · mask/(1 − p) · act'(x + b)` from x (pre-bias) and b, and optionally
//! `db = Σ_rows dx`, reduced deterministically (fixed-order two-stage sum, no atomics; on the GPU
//! the order depends on the device and the fused kernel's tuned launch shape, which `tune.json`
//! remembers, so the bits repeat run after run).
//!
//! **glu**: input `[..., 2n]` read as (gate | up) halves — **gate = the first n columns**, up = the
//! last n (Liger's and llm.c's convention) — output `[..., n]` = `act(gate) ⊙ up`. SwiGLU is
//! act = silu, GEGLU act = gelu_tanh (or gelu_erf). Backward: `d(input)` `[..., 2n]` with
//! `d(gate) = dout·up·act'(gate)`, `d(up) = dout·act(gate)`.
//!
//! Every tensor of a call has one float dtype (f32, bf16, f16); arithmetic is fp32.
//!
//! Variants — CPU: `naive` (one thread) → `parallel` (rows across cores). CUDA: `naive`
//! (unfused: one kernel per op with intermediate tensors, as an eager framework runs it) →
//! `fused` (one pass, 16-byte loads and stores). See kernels/activation.cu.

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
use crate::core::philox;
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "activation";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread, one pass per element", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "rows across cores; db summed by column blocks across cores in the same order", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "unfused: one scalar kernel per op (bias add, activation, dropout / multiply) with intermediate tensors", rank: 1 },
        VariantInfo {
            name: "fused",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "last dim (n for the GLU) a multiple of 16 bytes; 16-byte aligned tensors",
            summary: "one pass, 16-byte loads/stores, bias in registers, mask drawn in place; db from per-block partials",
            rank: 2,
        },
    ]
}

/// The activation after the bias (shared with matmul's epilogue, linear and moe).
pub use crate::core::act::Activation;

/// Dropout's parameters: drop probability and the stream handle `(seed, offset)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Dropout {
    /// Drop probability in [0, 1); 0 draws nothing.
    pub p: f32,
    /// The Philox key.
    pub seed: u64,
    /// The first Philox counter this call uses; the next call passes `offset +
    /// philox::blocks_used(numel)`.
    pub offset: u64,
}

impl Dropout {
    /// The integer threshold and scale the kernels receive (None when p = 0: no mask).
    pub fn params(&self) -> Option<(u32, f32)> {
        (self.p > 0.0).then(|| (philox::keep_threshold(self.p), philox::keep_scale(self.p)))
    }
}

/// Options of a bias + activation + dropout call. `Default`: best variant, the device's own
/// stream, no activation, no dropout.
#[derive(Clone, Debug, Default)]
pub struct ActOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// The activation after the bias.
    pub act: Activation,
    /// Dropout after the activation.
    pub dropout: Dropout,
}

/// Options of a GLU call. `Default`: best variant, the device's own stream, and no activation
/// (a plain bilinear gate: set `act` for SwiGLU or GEGLU).
#[derive(Clone, Debug, Default)]
pub struct GluOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// silu: SwiGLU; gelu_tanh / gelu_erf: GEGLU.
    pub act: Activation,
}

/// A validated problem: `rows` × `cols` elementwise (for the GLU, `cols` = n, the output width).
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// Rows: every dim but the last folded.
    pub rows: usize,
    /// Elements per output row.
    pub cols: usize,
    /// The shared dtype.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
    /// The activation.
    pub act: Activation,
    /// A GLU call (input rows `2·cols` wide).
    pub glu: bool,
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

fn check_distinct(
    op: &str,
    outs: &[(&str, Option<&Tensor>)],
    ins: &[Option<&Tensor>],
) -> Result<()> {
    for (i, (name, o)) in outs.iter().enumerate() {
        let Some(o) = o else { continue };
        let others = outs[..i].iter().filter_map(|(_, t)| *t);
        if ins
            .iter()
            .flatten()
            .copied()
            .chain(others)
            .any(|i| o.shares_storage(i))
        {
            return Err(Error::bad_arg(
                op,
                *name,
                "a buffer distinct from the inputs and other outputs",
                "a view of one of them",
            ));
        }
    }
    Ok(())
}

fn first_input(op: &str, arg: &str, x: &Tensor) -> Result<usize> {
    if x.rank() == 0 || !x.is_contiguous() || !FLOATS.contains(&x.dtype()) {
        return Err(Error::bad_arg(
            op,
            arg,
            "a contiguous f32/f16/bf16 tensor of rank ≥ 1",
            describe(x),
        ));
    }
    let cols = *x.shape().last().unwrap();
    if cols == 0 {
        return Err(Error::bad_arg(op, arg, "a last dim ≥ 1", describe(x)));
    }
    Ok(cols)
}

fn check_dropout(op: &str, d: &Dropout) -> Result<()> {
    if !(d.p >= 0.0 && d.p < 1.0) {
        return Err(Error::bad_arg(
            op,
            "dropout.p",
            "a probability in [0, 1)",
            d.p,
        ));
    }
    Ok(())
}

/// Checks a bias+act+dropout call; `g` is dy for the backward.
fn validate_act(
    op: &str,
    x: &Tensor,
    bias: Option<&Tensor>,
    g: Option<&Tensor>,
    outs: &[(&str, Option<&Tensor>)],
    opts: &ActOptions,
) -> Result<Problem> {
    let cols = first_input(op, "x", x)?;
    check_dropout(op, &opts.dropout)?;
    if let Some(b) = bias {
        expect_like(op, "bias", b, x, &[cols])?;
    }
    if let Some(g) = g {
        expect_like(op, "dy", g, x, x.shape())?;
    }
    for (name, o) in outs {
        let Some(o) = o else { continue };
        let shape: &[usize] = if *name == "dbias" { &[cols] } else { x.shape() };
        expect_like(op, name, o, x, shape)?;
    }
    check_distinct(op, outs, &[Some(x), bias, g])?;
    Ok(Problem {
        rows: x.numel() / cols,
        cols,
        dtype: x.dtype(),
        device: x.device(),
        act: opts.act,
        glu: false,
    })
}

/// Checks a GLU call: `input` [..., 2n]; `g` (dout) and the output shapes follow from it.
fn validate_glu(
    op: &str,
    input: &Tensor,
    g: Option<&Tensor>,
    out: (&str, &Tensor),
) -> Result<(usize, Vec<usize>)> {
    let two_n = first_input(op, "input", input)?;
    if two_n % 2 != 0 {
        return Err(Error::bad_arg(
            op,
            "input",
            "an even last dim (the gate and up halves)",
            describe(input),
        ));
    }
    let n = two_n / 2;
    let mut half = input.shape().to_vec();
    *half.last_mut().unwrap() = n;
    if let Some(g) = g {
        expect_like(op, "dout", g, input, &half)?;
    }
    let out_shape = if g.is_some() {
        input.shape().to_vec()
    } else {
        half
    };
    expect_like(op, out.0, out.1, input, &out_shape)?;
    check_distinct(op, &[(out.0, Some(out.1))], &[Some(input), g])?;
    Ok((n, out_shape))
}

/// Why `fused` cannot take rows of `cols` elements at these addresses, if so.
pub fn fused_unfit(p: &Problem, ptrs: &[u64]) -> Option<String> {
    let vec = rows::vec_width(p.dtype);
    if !p.cols.is_multiple_of(vec) {
        let what = if p.glu {
            "n (half the last dim)"
        } else {
            "the last dim"
        };
        return Some(format!(
            "needs {what} a multiple of {vec} for {} (got {})",
            p.dtype, p.cols
        ));
    }
    if ptrs.iter().any(|&a| a % 16 != 0) {
        return Some("needs 16-byte aligned tensors".into());
    }
    None
}

fn select(p: &Problem, requested: Option<&str>, ptrs: &[u64]) -> Result<&'static str> {
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
            (v.backend == Backend::Cuda && v.name == "fused")
                .then(|| fused_unfit(p, ptrs))
                .flatten()
        },
    )?;
    Ok(v.name)
}

fn ptrs(p: &Problem, ts: &[Option<&Tensor>]) -> Result<Vec<u64>> {
    if p.device.is_cuda() {
        ts.iter().flatten().map(|t| t.device_ptr()).collect()
    } else {
        Ok(vec![])
    }
}

/// y = dropout(act(x + bias)) into a caller-provided y.
pub fn bias_act_dropout_into(
    x: &Tensor,
    bias: Option<&Tensor>,
    y: &Tensor,
    opts: &ActOptions,
) -> Result<()> {
    let p = validate_act("bias_act_dropout", x, bias, None, &[("y", Some(y))], opts)?;
    let v = select(
        &p,
        opts.variant.as_deref(),
        &ptrs(&p, &[Some(x), bias, Some(y)])?,
    )?;
    match p.device {
        Device::Cpu => cpu::act_forward(v, &p, x, bias, y, &opts.dropout),
        Device::Cuda(_) => cuda::act_forward(v, &p, x, bias, y, opts),
    }
}

/// dx (and db when `dbias` is given; it needs `bias`) of `bias_act_dropout` with the same
/// options (act, p, seed, offset): the mask is redrawn, not read.
pub fn bias_act_dropout_backward_into(
    dy: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    dx: &Tensor,
    dbias: Option<&Tensor>,
    opts: &ActOptions,
) -> Result<()> {
    let op = "bias_act_dropout_backward";
    if dbias.is_some() && bias.is_none() {
        return Err(Error::bad_arg(
            op,
            "dbias",
            "None when no bias is given",
            "a tensor (but bias is None)",
        ));
    }
    let p = validate_act(
        op,
        x,
        bias,
        Some(dy),
        &[("dx", Some(dx)), ("dbias", dbias)],
        opts,
    )?;
    let v = select(
        &p,
        opts.variant.as_deref(),
        &ptrs(&p, &[Some(dy), Some(x), bias, Some(dx), dbias])?,
    )?;
    match p.device {
        Device::Cpu => cpu::act_backward(v, &p, dy, x, bias, dx, dbias, &opts.dropout),
        Device::Cuda(_) => cuda::act_backward(v, &p, dy, x, bias, dx, dbias, opts),
    }
}

/// Allocating form of `bias_act_dropout_into`.
pub fn bias_act_dropout(x: &Tensor, bias: Option<&Tensor>, opts: &ActOptions) -> Result<Tensor> {
    let y = Tensor::empty(x.shape(), x.dtype(), x.device())?;
    bias_act_dropout_into(x, bias, &y, opts)?;
    Ok(y)
}

/// out = act(gate) ⊙ up into a caller-provided out `[..., n]` (input `[..., 2n]` = gate | up).
pub fn glu_into(input: &Tensor, out: &Tensor, opts: &GluOptions) -> Result<()> {
    let op = "glu";
    let (n, _) = validate_glu(op, input, None, ("out", out))?;
    let p = Problem {
        rows: input.numel() / (2 * n),
        cols: n,
        dtype: input.dtype(),
        device: input.device(),
        act: opts.act,
        glu: true,
    };
    let v = select(
        &p,
        opts.variant.as_deref(),
        &ptrs(&p, &[Some(input), Some(out)])?,
    )?;
    match p.device {
        Device::Cpu => cpu::glu_forward(v, &p, input, out),
        Device::Cuda(_) => cuda::glu_forward(v, &p, input, out, opts),
    }
}

/// d(input) `[..., 2n]` of `glu` from dout `[..., n]` and the forward's input.
pub fn glu_backward_into(
    dout: &Tensor,
    input: &Tensor,
    dinput: &Tensor,
    opts: &GluOptions,
) -> Result<()> {
    let op = "glu_backward";
    let (_, _) = validate_glu(op, input, Some(dout), ("dinput", dinput))?;
    let n = input.shape().last().unwrap() / 2;
    let p = Problem {
        rows: input.numel() / (2 * n),
        cols: n,
        dtype: input.dtype(),
        device: input.device(),
        act: opts.act,
        glu: true,
    };
    let v = select(
        &p,
        opts.variant.as_deref(),
        &ptrs(&p, &[Some(dout), Some(input), Some(dinput)])?,
    )?;
    match p.device {
        Device::Cpu => cpu::glu_backward(v, &p, dout, input, dinput),
        Device::Cuda(_) => cuda::glu_backward(v, &p, dout, input, dinput, opts),
    }
}

/// Allocating GLU with activation `act`.
pub fn glu(input: &Tensor, act: Activation) -> Result<Tensor> {
    let mut shape = input.shape().to_vec();
    if let Some(l) = shape.last_mut() {
        *l /= 2;
    }
    let out = Tensor::empty(&shape, input.dtype(), input.device())?;
    glu_into(
        input,
        &out,
        &GluOptions {
            act,
            ..Default::default()
        },
    )?;
    Ok(out)
}

/// SwiGLU: silu(gate) ⊙ up, gate = the first half of the last dim.
pub fn swiglu(input: &Tensor) -> Result<Tensor> {
    glu(input, Activation::Silu)
}

/// GEGLU (tanh GELU): gelu_tanh(gate) ⊙ up, gate = the first half of the last dim.
pub fn geglu(input: &Tensor) -> Result<Tensor> {
    glu(input, Activation::GeluTanh)
}

/// The family as the harness sees it (check, bench, kernels).
pub struct ActivationFamily;

impl OpFamily for ActivationFamily {
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
