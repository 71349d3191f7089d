//! # linear — Y = act(X·Wᵀ + b) (+ R), forward and backward, and the fused QKV projection
//!
//! X is `[..., in]` (contiguous, or 2-D with stride 1 in its last dim), W is `[out, in]` (the
//! torch layout: stride 1 in its last dim, any row pitch), b is `[out]`, the residual R has Y's
//! shape (same layout rules as X), Y and the optional pre-activation Z (`X·Wᵀ + b`, saved for the
//! backward) are contiguous `[..., out]`. One float dtype (f32, bf16, f16) for all of them; the
//! math is fp32 with one rounding per output. On the GPU f32 runs as true fp32 (SIMT GEMM) or,
//! under `Precision::Tf32`, on tensor cores, as in matmul.
//!
//! Activations: none, ReLU, GELU (tanh approximation and exact erf), SiLU (`Activation`).
//!
//! **Backward** (given dY, X, W and Z): dZ = dY ⊙ act'(Z) fused with the bias gradient
//! db = Σ_rows dZ, reduced deterministically (per-block partial sums over fixed row chunks, then a
//! fixed-order sum: the same bits on every run, no atomics); dX = dZ·W and dW = dZᵀ·X through
//! ferrite's matmul on views (dZᵀ is a transposed view, nothing is copied). With no activation dZ
//! is dY itself.
//!
//! **Variants** (the ladder, docs/linear.md):
//! - CPU: `naive` (reference loops) → `parallel` (matmul's packed multi-core GEMM, then one fused
//!   epilogue pass over the rows).
//! - CUDA: `naive` (ferrite's best plain GEMM, then separate bias, activation and residual
//!   kernels: the unfused baseline, three more passes over Y) → `fused` (the epilogue inside
//!   `mma_pipelined`'s store step, element by element, sm_80+) → `persistent` (the same inside
//!   the Hopper `wgmma` persistent kernel, sm_90a) → `fused_pairs` / `persistent_pairs` (the
//!   same kernels with the pair epilogue: interior tiles branch-free in 2-element stores, the bias
//!   in registers, SFU activations). The epilogue is matmul's hook (`matmul::epilogue`). For at
//!   most 64 rows of X (decode) `skinny` runs the same epilogue on matmul's bandwidth-bound
//!   decode kernel (by default for at most 8 rows: matmul's `skinny_by_default`).
//!
//! **QKV**: [`linear_qkv`] runs one GEMM with W `[3·H·D, in]` into a `[..., 3, H, D]` buffer and
//! returns q, k, v as strided views of it (no copy; last dim contiguous).

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

pub use crate::core::act::Activation;

use crate::core::cuda::Stream;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily, Precision,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};
use crate::ops::matmul;

/// The forward's name in errors and tables.
pub const OP: &str = "linear";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];
const HALVES: &[DType] = &[DType::F16, DType::BF16];

/// The ladder, in order (forward; the backward shares the CPU names).
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo {
            name: "naive",
            backend: Backend::Cpu,
            dtypes: FLOATS,
            min_arch: None,
            constraints: "any shape",
            summary:
                "reference loops: one f32 dot product per output, then bias, activation, residual",
            rank: 1,
        },
        VariantInfo {
            name: "parallel",
            backend: Backend::Cpu,
            dtypes: FLOATS,
            min_arch: None,
            constraints: "any shape",
            summary:
                "matmul's packed SIMD GEMM on all cores (bf16/f16 widened to f32), then one fused \
                epilogue pass over the rows while they are warm",
            rank: 2,
        },
        VariantInfo {
            name: "naive",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "any shape",
            summary:
                "unfused: ferrite's best plain GEMM, then separate bias, activation and residual \
                kernels (each one more read and write of Y)",
            rank: 1,
        },
        VariantInfo {
            name: "fused",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "sm_80+; any shape; f32 only as tf32 (Precision::Tf32)",
            summary:
                "bias, Z, activation and residual applied to mma_pipelined's fp32 accumulators \
                in its store step: Y written once, never re-read",
            rank: 2,
        },
        VariantInfo {
            name: "persistent",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(Arch::SM90),
            constraints: "sm_90a (Hopper); bf16/f16; any shape: X or W with rows TMA cannot \
                address (an `in` or row pitch not a multiple of 8 elements, a base off 16 bytes) \
                is re-pitched first (matmul's pre-pass); by default only from 2^24 \
                multiply-adds, `fused` below",
            summary: "the same epilogue inside the Hopper wgmma kernel (TMA, warp-specialised, \
                persistent grid, 2-block clusters)",
            rank: 3,
        },
        VariantInfo {
            name: "fused_pairs",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "sm_80+; any shape; f32 only as tf32 (Precision::Tf32)",
            summary:
                "`fused` with the pair epilogue: interior warp tiles stored as 2-element pairs, \
                bias pairs in registers, SFU activations (16-bit); the kernel compiled for the \
                layer's layout only, so it keeps mma_pipelined's 4 stages",
            rank: 4,
        },
        VariantInfo {
            name: "persistent_pairs",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(Arch::SM90),
            constraints: "sm_90a (Hopper); bf16/f16; any shape: X or W with rows TMA cannot \
                address is re-pitched first (matmul's pre-pass); by default only from 2^24 \
                multiply-adds, `fused_pairs` below",
            summary: "`persistent` with the pair epilogue: interior 128×256 tiles branch-free, \
                the bias loaded into registers before the tile's mainloop, 4-byte stores, \
                tanh.approx (16-bit)",
            rank: 5,
        },
        VariantInfo {
            name: "skinny",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(Arch::SM80),
            constraints: "sm_80+; bf16/f16; at most 64 rows of X (decode; declined above, where \
                the tiled variants run); any in, out and alignment. Chosen by default for at most 8 \
                rows (matmul's skinny_by_default)",
            summary: "the epilogue on matmul's `skinny` decode kernel: W streamed once with \
                every SM busy (a warp per 16 outputs and a k-slice, mma.sync), bias, Z, \
                activation and residual applied as the outputs are stored",
            rank: 6,
        },
    ]
}

/// Options of one call. `Default`: best variant, no activation, fp32 precision for f32, the
/// device's own stream, all CPU cores.
#[derive(Clone, Debug)]
pub struct LinearOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// The activation after the bias (forward), whose derivative the backward applies.
    pub activation: Activation,
    /// For f32 inputs on the GPU: `F32` (true fp32) or `Tf32` (tensor cores). Ignored otherwise.
    pub precision: Precision,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// CPU threads for `parallel` (0 = all cores).
    pub threads: usize,
}

impl Default for LinearOptions {
    fn default() -> Self {
        LinearOptions {
            variant: None,
            activation: Activation::None,
            precision: Precision::F32,
            stream: None,
            threads: 0,
        }
    }
}

impl LinearOptions {
    fn matmul(&self) -> matmul::MatmulOptions {
        matmul::MatmulOptions {
            precision: self.precision,
            stream: self.stream.clone(),
            threads: self.threads,
            ..Default::default()
        }
    }
}

/// Forward inputs.
#[derive(Clone, Copy)]
pub struct Fwd<'a> {
    /// The input `[..., in]`.
    pub x: &'a Tensor,
    /// The weight `[out, in]`.
    pub w: &'a Tensor,
    /// The bias `[out]`, added before the activation.
    pub bias: Option<&'a Tensor>,
    /// Added after the activation, Y's shape.
    pub residual: Option<&'a Tensor>,
}

/// Forward outputs (caller-provided): Y and, when wanted, the pre-activation Z.
#[derive(Clone, Copy)]
pub struct FwdOut<'a> {
    /// The output `[..., out]`, contiguous.
    pub y: &'a Tensor,
    /// The pre-activation X·Wᵀ + b, Y's shape: the backward of an activation needs it.
    pub z: Option<&'a Tensor>,
}

/// Backward inputs: Z is required unless the activation is none.
#[derive(Clone, Copy)]
pub struct Bwd<'a> {
    /// The gradient of Y, Y's shape.
    pub dy: &'a Tensor,
    /// The forward's input.
    pub x: &'a Tensor,
    /// The forward's weight.
    pub w: &'a Tensor,
    /// The forward's pre-activation (required when `LinearOptions::activation` is not none).
    pub z: Option<&'a Tensor>,
    /// The input's own pre-activation when X = act_in(Z_in) (the output of the layer below):
    /// the `dx` output then receives dZ_in = dX ⊙ act_in'(Z_in), the layer below's dZ, formed in
    /// the dX GEMM's epilogue on the GPU (`wgmma`) instead of by a pass of its own. A chain of
    /// layers then runs each activation's backward inside a GEMM; the layer below takes that dZ
    /// as its `dy` with no activation.
    pub x_pre: Option<(&'a Tensor, Activation)>,
}

/// Backward outputs; any may be left out.
#[derive(Clone, Copy)]
pub struct BwdOut<'a> {
    /// The gradient of X, X's shape.
    pub dx: Option<&'a Tensor>,
    /// The gradient of W, `[out, in]`.
    pub dw: Option<&'a Tensor>,
    /// The gradient of the bias, `[out]`.
    pub db: Option<&'a Tensor>,
    /// With `Bwd::x_pre` and `dx`: the layer below's bias gradient `[in]`, the column sums of
    /// the dZ_in that `dx` receives. On the GPU the dX GEMM's activation-backward epilogue writes
    /// them per 16-row group from its staging tiles and one small fixed-order reduction finishes
    /// them (where every tile takes that path: rows a multiple of 64, `in` a multiple of 256,
    /// aligned tensors; else a pass over dx), so a chain of layers reads no dZ for its biases.
    pub db_pre: Option<&'a Tensor>,
}

/// A validated problem: m rows (tokens), n = out, k = in.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// Rows of X and Y: every leading dim folded (tokens).
    pub m: usize,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// The shared dtype.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

impl Problem {
    /// `m×n←k`, as the tables show it.
    pub fn label(&self) -> String {
        format!("{}×{}←{}", self.m, self.n, self.k)
    }
    /// The forward GEMM's 2·m·n·k.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// The `[rows, cols]` view of a tensor whose last dim is `cols`: itself when 2-D with stride 1 in
/// its last dim, a reshape when contiguous; anything else is refused.
pub fn rows_view(op: &str, arg: &str, t: &Tensor) -> Result<Tensor> {
    let r = t.rank();
    let cols = t.shape().last().copied().unwrap_or(0);
    if r == 2 && (t.strides()[1] == 1 || cols <= 1) && t.strides()[0] >= cols {
        return Ok(t.clone());
    }
    if r >= 1 && t.is_contiguous() {
        let rows: usize = t.shape()[..r - 1].iter().product();
        return t.reshape(&[rows, cols]);
    }
    Err(Error::bad_arg(
        op,
        arg,
        "a contiguous tensor, or 2-D with stride 1 in its last dim",
        describe(t),
    ))
}

fn expect_same(op: &str, arg: &str, t: &Tensor, like: &Tensor, shape: &[usize]) -> Result<()> {
    if t.device() != like.device() || t.dtype() != like.dtype() || t.shape() != shape {
        return Err(Error::bad_arg(
            op,
            arg,
            format!("a {}{shape:?} tensor on {}", like.dtype(), like.device()),
            describe(t),
        ));
    }
    Ok(())
}

fn expect_contiguous(op: &str, arg: &str, t: &Tensor) -> Result<()> {
    if !t.is_contiguous() {
        return Err(Error::bad_arg(op, arg, "a contiguous tensor", describe(t)));
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
        let clash_in = ins.iter().flatten().any(|t| o.shares_storage(t));
        let clash_out = outs[..i]
            .iter()
            .filter_map(|(_, t)| *t)
            .any(|t| o.shares_storage(t));
        if clash_in || clash_out {
            return Err(Error::bad_arg(
                op,
                *name,
                "a buffer distinct from the inputs and the other outputs",
                "a view of another argument",
            ));
        }
    }
    Ok(())
}

/// X and W against each other: (m, n, k, the out shape `[..., n]`).
fn xw(op: &str, x: &Tensor, w: &Tensor) -> Result<(usize, usize, usize, Vec<usize>)> {
    if x.rank() == 0 || !FLOATS.contains(&x.dtype()) {
        return Err(Error::bad_arg(
            op,
            "x",
            "an f32/f16/bf16 tensor [..., in]",
            describe(x),
        ));
    }
    let k = *x.shape().last().unwrap();
    if w.rank() != 2 || w.device() != x.device() || w.dtype() != x.dtype() || w.shape()[1] != k {
        return Err(Error::bad_arg(
            op,
            "w",
            format!(
                "a {}[out, {k}] tensor on {} (like x)",
                x.dtype(),
                x.device()
            ),
            describe(w),
        ));
    }
    if !(w.strides()[1] == 1 || k <= 1) {
        return Err(Error::bad_arg(
            op,
            "w",
            "stride 1 in its last dim (torch layout [out, in])",
            describe(w),
        ));
    }
    let n = w.shape()[0];
    let m: usize = x.shape()[..x.rank() - 1].iter().product();
    let mut out = x.shape().to_vec();
    *out.last_mut().unwrap() = n;
    Ok((m, n, k, out))
}

/// Checks a forward's tensors against each other (shapes, dtypes, devices, layouts, no output
/// aliasing an input) and returns the problem.
pub fn validate_fwd(i: &Fwd, o: &FwdOut) -> Result<Problem> {
    let (m, n, k, out_shape) = xw(OP, i.x, i.w)?;
    rows_view(OP, "x", i.x)?;
    if let Some(b) = i.bias {
        expect_same(OP, "bias", b, i.x, &[n])?;
        expect_contiguous(OP, "bias", b)?;
    }
    if let Some(r) = i.residual {
        expect_same(OP, "residual", r, i.x, &out_shape)?;
        rows_view(OP, "residual", r)?;
    }
    expect_same(OP, "y", o.y, i.x, &out_shape)?;
    expect_contiguous(OP, "y", o.y)?;
    if let Some(z) = o.z {
        expect_same(OP, "z", z, i.x, &out_shape)?;
        expect_contiguous(OP, "z", z)?;
    }
    check_distinct(
        OP,
        &[("y", Some(o.y)), ("z", o.z)],
        &[Some(i.x), Some(i.w), i.bias, i.residual],
    )?;
    for (name, v) in [("rows", m), ("out", n), ("in", k)] {
        if v > i32::MAX as usize {
            return Err(Error::bad_arg(OP, name, format!("≤ {}", i32::MAX), v));
        }
    }
    Ok(Problem {
        m,
        n,
        k,
        dtype: i.x.dtype(),
        device: i.x.device(),
    })
}

/// The backward's name in errors.
pub const OP_BWD: &str = "linear_backward";

/// Checks a backward's tensors as [`validate_fwd`] does, and that Z is given when `act` needs it.
pub fn validate_bwd(i: &Bwd, o: &BwdOut, act: Activation) -> Result<Problem> {
    let op = OP_BWD;
    let (m, n, k, out_shape) = xw(op, i.x, i.w)?;
    rows_view(op, "x", i.x)?;
    expect_same(op, "dy", i.dy, i.x, &out_shape)?;
    rows_view(op, "dy", i.dy)?;
    match (act, i.z) {
        (Activation::None, _) => {}
        (_, None) => {
            return Err(Error::bad_arg(
                op,
                "z",
                format!("the pre-activation saved by the forward ({act} needs it)"),
                "None",
            ))
        }
        (_, Some(z)) => {
            expect_same(op, "z", z, i.x, &out_shape)?;
            rows_view(op, "z", z)?;
        }
    }
    if let Some((z_in, _)) = i.x_pre {
        expect_same(op, "x_pre", z_in, i.x, i.x.shape())?;
        rows_view(op, "x_pre", z_in)?;
    }
    if let Some(dx) = o.dx {
        expect_same(op, "dx", dx, i.x, i.x.shape())?;
        expect_contiguous(op, "dx", dx)?;
    }
    if let Some(dw) = o.dw {
        expect_same(op, "dw", dw, i.x, &[n, k])?;
        expect_contiguous(op, "dw", dw)?;
    }
    if let Some(db) = o.db {
        expect_same(op, "db", db, i.x, &[n])?;
        expect_contiguous(op, "db", db)?;
    }
    if let Some(dbp) = o.db_pre {
        if i.x_pre.is_none() || o.dx.is_none() {
            return Err(Error::bad_arg(
                op,
                "db_pre",
                "`x_pre` and `dx` alongside it (the layer below's bias gradient sums its dZ, \
                 which dx receives)",
                format!(
                    "x_pre {}, dx {}",
                    if i.x_pre.is_some() { "given" } else { "None" },
                    if o.dx.is_some() { "given" } else { "None" }
                ),
            ));
        }
        expect_same(op, "db_pre", dbp, i.x, &[k])?;
        expect_contiguous(op, "db_pre", dbp)?;
    }
    check_distinct(
        op,
        &[
            ("dx", o.dx),
            ("dw", o.dw),
            ("db", o.db),
            ("db_pre", o.db_pre),
        ],
        &[Some(i.dy), Some(i.x), Some(i.w), i.z, i.x_pre.map(|p| p.0)],
    )?;
    for (name, v) in [("rows", m), ("out", n), ("in", k)] {
        if v > i32::MAX as usize {
            return Err(Error::bad_arg(op, name, format!("≤ {}", i32::MAX), v));
        }
    }
    Ok(Problem {
        m,
        n,
        k,
        dtype: i.x.dtype(),
        device: i.x.device(),
    })
}

/// The GEMM of the forward: X `[m, k]` · Wᵀ (W's transposed view) into Y `[m, n]`.
pub fn gemm_of(i: &Fwd, y: &Tensor) -> Result<matmul::Gemm> {
    let x2 = rows_view(OP, "x", i.x)?;
    let y2 = rows_view(OP, "y", y)?;
    let mut g = matmul::validate(&x2, &i.w.t()?, &y2)?;
    // B = Wᵀ is column-major; a k ≤ 1 or n = 1 W reads as row-major too. Keep the layer's
    // layout so such shapes run the kernel compiled for it (the pair epilogue kernels exist for
    // this layout only: another one would be compiled, seconds, at first use).
    g.b = g.b.relaid(g.k, g.n, true).unwrap_or(g.b);
    Ok(g)
}

fn precision_of(dtype: DType, opts: &LinearOptions) -> Precision {
    match dtype {
        DType::F32 => opts.precision,
        d => Precision::of(d),
    }
}

/// Picks the variant for a forward problem (`g`: its GEMM, on a GPU).
pub fn select(p: &Problem, g: Option<&matmul::Gemm>, opts: &LinearOptions) -> Result<VariantInfo> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let prec = precision_of(p.dtype, opts);
    let v = variant::select(
        OP,
        &vs,
        opts.variant.as_deref(),
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            if v.backend != Backend::Cuda {
                return None;
            }
            match v.name {
                "fused" | "fused_pairs" if prec == Precision::F32 => Some(
                    "runs f32 only as tf32 (ask for Precision::Tf32); `naive` is true fp32"
                        .to_string(),
                ),
                "persistent" | "persistent_pairs" => {
                    cuda::persistent_declines(g?, arch, opts.variant.is_some())
                }
                "skinny" => crate::ops::matmul::cuda::skinny_refuses(g?, opts.variant.is_some()),
                _ => None,
            }
        },
    )?;
    Ok(v.clone())
}

/// Y = act(X·Wᵀ + b) (+ residual), Z = X·Wᵀ + b when asked for, into caller-provided outputs.
pub fn forward_into(i: &Fwd, o: &FwdOut, opts: &LinearOptions) -> Result<()> {
    let p = validate_fwd(i, o)?;
    let g = if p.device.is_cuda() {
        Some(gemm_of(i, o.y)?)
    } else {
        None
    };
    let v = select(&p, g.as_ref(), opts)?;
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    match p.device {
        Device::Cpu => cpu::forward(v.name, &p, i, o, opts),
        Device::Cuda(_) => cuda::forward(v.name, &p, &g.unwrap(), i, o, opts),
    }
}

/// dX, dW, db from dY (and Z for an activation), into caller-provided outputs. The variant in
/// `opts` names the CPU path (`naive` or `parallel`); on the GPU every variant shares one backward
/// (the dZ + db kernel, then matmul's best GEMMs).
///
/// A forward that keeps Z, then the backward, on the CPU:
///
/// ```rust
/// use ferrite::ops::linear::{self, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions};
/// use ferrite::{DType, Device, Tensor};
/// let cpu = Device::Cpu;
/// let x = Tensor::rand(&[8, 32], DType::F32, cpu, 1, -1.0, 1.0)?;
/// let w = Tensor::rand(&[16, 32], DType::F32, cpu, 2, -0.2, 0.2)?; // [out, in]
/// let b = Tensor::rand(&[16], DType::F32, cpu, 3, -0.1, 0.1)?;
/// let opts = LinearOptions { activation: Activation::GeluTanh, ..Default::default() };
/// let y = Tensor::empty(&[8, 16], DType::F32, cpu)?;
/// let z = Tensor::empty(&[8, 16], DType::F32, cpu)?; // the pre-activation, for the backward
/// let fwd = Fwd { x: &x, w: &w, bias: Some(&b), residual: None };
/// linear::forward_into(&fwd, &FwdOut { y: &y, z: Some(&z) }, &opts)?;
///
/// let dy = Tensor::full(&[8, 16], DType::F32, cpu, 1.0)?;
/// let dx = Tensor::empty(&[8, 32], DType::F32, cpu)?;
/// let dw = Tensor::empty(&[16, 32], DType::F32, cpu)?;
/// let db = Tensor::empty(&[16], DType::F32, cpu)?;
/// let bwd = Bwd { dy: &dy, x: &x, w: &w, z: Some(&z), x_pre: None };
/// let out = BwdOut { dx: Some(&dx), dw: Some(&dw), db: Some(&db), db_pre: None };
/// linear::backward_into(&bwd, &out, &opts)?;
/// assert!(db.to_vec::<f32>()?.iter().all(|g| g.is_finite()));
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn backward_into(i: &Bwd, o: &BwdOut, opts: &LinearOptions) -> Result<()> {
    let act = opts.activation;
    let p = validate_bwd(i, o, act)?;
    let vs = variants();
    let v = variant::select(
        OP_BWD,
        &vs,
        opts.variant.as_deref(),
        Backend::of(p.device),
        p.dtype,
        None,
        |_| None,
    )?;
    match p.device {
        Device::Cpu => cpu::backward(v.name, &p, i, o, opts),
        Device::Cuda(_) => cuda::backward(v.name, &p, i, o, opts),
    }
}

/// The out shape `[..., out]` for X `[..., in]` and W `[out, in]`.
fn out_shape(x: &Tensor, w: &Tensor) -> Result<Vec<usize>> {
    Ok(xw(OP, x, w)?.3)
}

/// Y = act(X·Wᵀ + b) into a new tensor (activation and variant from `opts`).
pub fn linear_with(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    opts: &LinearOptions,
) -> Result<Tensor> {
    let y = Tensor::empty(&out_shape(x, w)?, x.dtype(), x.device())?;
    forward_into(
        &Fwd {
            x,
            w,
            bias,
            residual: None,
        },
        &FwdOut { y: &y, z: None },
        opts,
    )?;
    Ok(y)
}

/// X·Wᵀ + b with the best variant.
///
/// ```rust
/// use ferrite::{DType, Device, Tensor};
/// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let w = Tensor::from_vec(vec![1.0f32, 0.0, 1.0, 1.0, 0.0, -1.0], &[3, 2])?; // [out, in]
/// let b = Tensor::full(&[3], DType::F32, Device::Cpu, 0.5)?;
/// let y = ferrite::ops::linear::linear(&x, &w, Some(&b))?;
/// assert_eq!(y.to_vec::<f32>()?, vec![1.5, 3.5, -1.5, 3.5, 7.5, -3.5]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_with(x, w, bias, &LinearOptions::default())
}

/// The QKV projection as one GEMM: W is `[3·heads·head_dim, in]` (q rows, then k, then v), the
/// output a `[..., 3, heads, head_dim]` buffer; returns q, k, v as `[..., heads, head_dim]` views
/// of it (strided over the token dims, last dim contiguous; nothing is copied).
pub fn linear_qkv(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    heads: usize,
    head_dim: usize,
    opts: &LinearOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let hd = heads * head_dim;
    if heads == 0 || head_dim == 0 {
        return Err(Error::bad_arg(
            OP,
            "heads/head_dim",
            "both ≥ 1",
            format!("{heads}/{head_dim}"),
        ));
    }
    if w.rank() != 2 || w.shape()[0] != 3 * hd {
        return Err(Error::bad_arg(
            OP,
            "w",
            format!(
                "[3·{heads}·{head_dim} = {}, in] (q, k, v rows stacked)",
                3 * hd
            ),
            describe(w),
        ));
    }
    let flat = out_shape(x, w)?;
    let lead = &flat[..flat.len() - 1];
    let mut shape = lead.to_vec();
    shape.extend([3, heads, head_dim]);
    let buf = Tensor::empty(&shape, x.dtype(), x.device())?;
    let y = buf.reshape(&flat)?;
    forward_into(
        &Fwd {
            x,
            w,
            bias,
            residual: None,
        },
        &FwdOut { y: &y, z: None },
        opts,
    )?;
    let mut vshape = lead.to_vec();
    vshape.extend([heads, head_dim]);
    let st = buf.strides();
    let mut vstrides = st[..lead.len()].to_vec();
    vstrides.extend([head_dim, 1]);
    let base = buf.layout().offset();
    let view = |i: usize| buf.as_strided(&vshape, &vstrides, base + i * hd);
    Ok((view(0)?, view(1)?, view(2)?))
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Linear;

impl OpFamily for Linear {
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
