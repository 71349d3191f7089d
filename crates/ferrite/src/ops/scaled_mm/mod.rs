//! # scaled_mm — FP8 GEMM with scales: D = (sa ⊙ A)·(sb ⊙ B)ᵀ + bias
//!
//! A `[m, k]` and B `[n, k]` in FP8 (`f8e4m3` or `f8e5m2`, either operand; see `core::fp8`), k
//! contiguous in both — a linear layer's weight as it is stored, and what `torch._scaled_mm(a,
//! b, ...)` takes as `b.t()`: `scaled_mm(a, w, ...)` here is `torch._scaled_mm(a, w.t(), ...)`.
//! The scales are the dequantisation factors (A ≈ sa·A₈), f32 on the operands' device: one per
//! tensor (`[1]`) or one per row of A (`[m]`) and one per row of B, i.e. per output column
//! (`[n]`) — torch's tensor-wise and row-wise recipes. D is `[m, n]` in bf16, f16 or f32, bias
//! `[n]` in D's dtype. Accumulation in fp32: `D[i][j] = sa(i)·sb(j)·Σ_p A[i][p]·B[j][p] + bias[j]`.
//!
//! Variants — CPU: `naive` (one thread, each element decoded as it is read) → `parallel` (A and
//! B decoded once through a 256-entry table, rows of D across cores). CUDA: `naive` (a thread
//! per output, software decoding, any GPU) → `wgmma_fast` (Hopper FP8 tensor cores, 128×256
//! tiles, the whole k sum in the tensor core's accumulator) → `wgmma` (128×192 or 128×128
//! tiles, each 128-deep partial sum promoted into fp32 registers: the accuracy of cuBLASLt's
//! default). See kernels/wgmma.cu and docs/scaled_mm.md.
//!
//! Scales are read where they live: on the CPU their values are checked (finite, non-zero);
//! on the GPU they are read by the kernel (a check would cost a synchronisation per call), so
//! a NaN or Inf scale shows as NaN/Inf in D, never as a plausible number.

#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod cpu;
#[doc(hidden)]
pub mod cuda;
pub mod quantize;

use crate::core::cuda::Stream;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "scaled_mm";
/// The input dtypes (either operand may be either format).
pub const FP8: &[DType] = &[DType::F8E4M3, DType::F8E5M2];
/// The output dtypes.
pub const OUT_DTYPES: &[DType] = &[DType::BF16, DType::F16, DType::F32];

/// The Hopper rungs' architecture: FP8 wgmma exists on sm_90a only.
pub const WGMMA_ARCH: &str = "needs sm_90a (Hopper, compute capability 9.x)";

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FP8, min_arch: None, constraints: "any shape", summary: "one thread; each FP8 element decoded as it is read, an fp32 dot product per output", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FP8, min_arch: None, constraints: "any shape", summary: "A and B decoded once through a 256-entry table, rows of D across cores", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FP8, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a thread per output, FP8 decoded in integer arithmetic, no reuse of A or B", rank: 1 },
        VariantInfo {
            name: "wgmma_fast",
            backend: Backend::Cuda,
            dtypes: FP8,
            min_arch: Some(Arch::SM90),
            constraints: "sm_90a; k > 0; A and B 16-byte aligned with row pitches of 16-byte multiples (TMA)",
            summary: "FP8 wgmma (m64n256k32) fed by TMA, warp-specialised, persistent; the whole k sum in the tensor core's accumulator (torch's use_fast_accum)",
            rank: 2,
        },
        VariantInfo {
            name: "wgmma",
            backend: Backend::Cuda,
            dtypes: FP8,
            min_arch: Some(Arch::SM90),
            constraints: "as `wgmma_fast`",
            summary: "128×192 tiles (128×128 where whole waves favour them); each 128-deep partial sum added into fp32 registers (promotion: cuBLASLt's accuracy without FAST_ACCUM)",
            rank: 3,
        },
    ]
}

/// Options of one call. `Default`: the best variant, the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct ScaledMmOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

/// A validated problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    /// Rows of A and D.
    pub m: usize,
    /// Rows of B, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// Elements between rows of A, B and D.
    pub lda: usize,
    /// See `lda`.
    pub ldb: usize,
    /// See `lda`.
    pub ldd: usize,
    /// A's format.
    pub a_dtype: DType,
    /// B's format.
    pub b_dtype: DType,
    /// D's (and the bias's) dtype.
    pub out_dtype: DType,
    /// One scale per row of A (else one for the tensor).
    pub sa_row: bool,
    /// One scale per row of B, i.e. per column of D (else one for the tensor).
    pub sb_col: bool,
    /// A bias is added.
    pub bias: bool,
    /// The shared device.
    pub device: Device,
}

impl Problem {
    /// Dense operands (rows k, k and n elements apart), tensor-wise scales, no bias: tests,
    /// checks and benches set the other fields as they need.
    pub fn dense(
        (m, n, k): (usize, usize, usize),
        (a_dtype, b_dtype, out_dtype): (DType, DType, DType),
        device: Device,
    ) -> Problem {
        Problem {
            m,
            n,
            k,
            lda: k,
            ldb: k,
            ldd: n,
            a_dtype,
            b_dtype,
            out_dtype,
            sa_row: false,
            sb_col: false,
            bias: false,
            device,
        }
    }
    /// `m×n×k a×b→out` for labels.
    pub fn label(&self) -> String {
        format!(
            "{}×{}×{} {}×{}→{}",
            self.m, self.n, self.k, self.a_dtype, self.b_dtype, self.out_dtype
        )
    }
    /// Multiply-adds × 2.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// A scale tensor: f32, contiguous, one element or `per` elements; returns whether it is per
/// row / column.
fn scale_of(op: &str, name: &str, t: &Tensor, per: usize, per_what: &str) -> Result<bool> {
    let n = t.numel();
    if t.dtype() != DType::F32 || !t.is_contiguous() || (n != 1 && n != per) || t.rank() > 2 {
        return Err(Error::bad_arg(
            op,
            name,
            format!(
                "a contiguous f32 tensor of 1 element (per tensor) or {per} ({per_what}), rank ≤ 2"
            ),
            describe(t),
        ));
    }
    Ok(n != 1)
}

fn validate(
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<Problem> {
    for (name, t) in [("a", a), ("b", b)] {
        if !t.dtype().is_fp8() {
            return Err(Error::bad_arg(
                OP,
                name,
                "an FP8 tensor (f8e4m3 or f8e5m2)",
                describe(t),
            ));
        }
    }
    let (m, k, lda) = a.matrix_rows(OP, "a", "[m, k]")?;
    let (n, kb, ldb) = b.matrix_rows(OP, "b", "[n, k] (a weight's layout: torch's b.t())")?;
    if kb != k {
        return Err(Error::bad_arg(
            OP,
            "b",
            format!("[n, {k}] (k as in a: {})", describe(a)),
            describe(b),
        ));
    }
    if !OUT_DTYPES.contains(&out.dtype()) || out.shape() != [m, n] {
        return Err(Error::bad_arg(
            OP,
            "out",
            format!("a bf16, f16 or f32 tensor of shape [{m}, {n}]"),
            describe(out),
        ));
    }
    let (_, _, ldd) = out.matrix_rows(OP, "out", "[m, n]")?;
    let sa_row = scale_of(OP, "scale_a", scale_a, m, "per row of a")?;
    let sb_col = scale_of(OP, "scale_b", scale_b, n, "per row of b: per output column")?;
    if let Some(bias) = bias {
        if bias.dtype() != out.dtype() || bias.shape() != [n] || !bias.is_contiguous() {
            return Err(Error::bad_arg(
                OP,
                "bias",
                format!(
                    "a contiguous [{n}] tensor of the output's dtype ({})",
                    out.dtype()
                ),
                describe(bias),
            ));
        }
    }
    let device = out.device();
    let ins = [
        ("a", a),
        ("b", b),
        ("scale_a", scale_a),
        ("scale_b", scale_b),
    ];
    out.expect_output_of(OP, ins.iter().copied().chain(bias.map(|t| ("bias", t))))?;
    Ok(Problem {
        m,
        n,
        k,
        lda,
        ldb,
        ldd,
        a_dtype: a.dtype(),
        b_dtype: b.dtype(),
        out_dtype: out.dtype(),
        sa_row,
        sb_col,
        bias: bias.is_some(),
        device,
    })
}

/// Why a `wgmma` rung cannot run `p` with operands at `ptrs` ([a, b]; empty: alignment not
/// known yet) on `arch` (None: it can).
pub fn wgmma_declines(p: &Problem, arch: Option<Arch>, ptrs: &[u64]) -> Option<String> {
    if arch.is_some_and(|a| a.major != 9) {
        return Some(WGMMA_ARCH.into());
    }
    if p.k == 0 {
        return Some("needs k > 0 (D = bias: the naive rung writes it)".into());
    }
    if p.m > i32::MAX as usize - 256 || p.n > i32::MAX as usize - 256 {
        return Some("needs m, n < 2^31 − 256 (32-bit TMA coordinates)".into());
    }
    for (name, ld, ptr) in [("a", p.lda, ptrs.first()), ("b", p.ldb, ptrs.get(1))] {
        if !ld.is_multiple_of(16) || ptr.is_some_and(|q| !q.is_multiple_of(16)) {
            return Some(format!(
                "needs `{name}` 16-byte aligned with a row pitch of a multiple of 16 elements (TMA); it has pitch {ld}"
            ));
        }
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
        p.a_dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda && v.name.starts_with("wgmma"))
                .then(|| wgmma_declines(p, arch, ptrs))
                .flatten()
        },
    )?;
    Ok(v.name)
}

/// D = (scale_a ⊙ a)·(scale_b ⊙ b)ᵀ (+ bias) into a caller-provided `out` (see the module docs
/// for the shapes).
pub fn scaled_mm_into(
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    opts: &ScaledMmOptions,
) -> Result<()> {
    let p = validate(a, b, scale_a, scale_b, bias, out)?;
    let ptrs = if p.device.is_cuda() {
        vec![a.device_ptr()?, b.device_ptr()?]
    } else {
        vec![]
    };
    let v = select(&p, opts.variant.as_deref(), &ptrs)?;
    match p.device {
        Device::Cpu => cpu::run(v, &p, a, b, scale_a, scale_b, bias, out),
        Device::Cuda(_) => cuda::run(v, &p, a, b, scale_a, scale_b, bias, out, opts),
    }
}

/// D = (scale_a ⊙ a)·(scale_b ⊙ b)ᵀ (+ bias) as a new `[m, n]` tensor of `out_dtype`, with the
/// best variant.
///
/// ```rust
/// use ferrite::{DType, Device, Tensor};
/// use ferrite::ops::scaled_mm::scaled_mm;
/// // 1×2 · (2×2)ᵀ in e4m3, scales 0.5 and 2 (so the product's scale is 1).
/// let a = Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2])?.to_dtype(DType::F8E4M3)?;
/// let b = Tensor::from_vec(vec![1.0f32, 1.0, 3.0, -1.0], &[2, 2])?.to_dtype(DType::F8E4M3)?;
/// let sa = Tensor::from_vec(vec![0.5f32], &[1])?;
/// let sb = Tensor::from_vec(vec![2.0f32], &[1])?;
/// let d = scaled_mm(&a, &b, &sa, &sb, None, DType::F32)?;
/// assert_eq!(d.to_vec::<f32>()?, vec![3.0, 1.0]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn scaled_mm(
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    out_dtype: DType,
) -> Result<Tensor> {
    let (m, n) = (
        a.shape().first().copied().unwrap_or(0),
        b.shape().first().copied().unwrap_or(0),
    );
    let out = Tensor::empty(&[m, n], out_dtype, a.device())?;
    scaled_mm_into(
        a,
        b,
        scale_a,
        scale_b,
        bias,
        &out,
        &ScaledMmOptions::default(),
    )?;
    Ok(out)
}

/// The family as the harness sees it (check, bench, kernels).
pub struct ScaledMm;

impl OpFamily for ScaledMm {
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
    fn peers(&self) -> Vec<&'static str> {
        // cuBLASLt's rows, and `quantize` (the quantisation's own records).
        let mut v = check::PEERS.to_vec();
        v.push("quantize");
        v
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        let mut v = cuda::kernel_specs();
        v.extend(quantize::kernel_specs());
        v
    }
}

#[cfg(test)]
mod tests;
