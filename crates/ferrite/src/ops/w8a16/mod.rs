//! # w8a16 — int8 weights, 16-bit activations: D = A·(s ⊙ W)ᵀ + bias
//!
//! Weight-only quantisation as inference uses it: a linear layer's weight W `[n, k]` stored as
//! int8 with one f32 scale per output channel (`s [n]`, W ≈ s·W₈), the activations A `[m, k]`
//! in bf16 or f16, D `[m, n]` in A's dtype, bias `[n]` (optional) in A's dtype; fp32
//! accumulation: `D[i][j] = s[j]·Σ_p A[i][p]·W₈[j][p] + bias[j]` — the semantics of PyTorch's
//! `torch._weight_int8pack_mm(a, w, s)` (plus the bias). In decoding (m = 1…16) the product is a
//! stream over the weight, and int8 halves the bytes a bf16 weight needs: that is the speed-up.
//! [`quantize_int8`] makes W₈ and s from a float weight (symmetric, per output channel).
//!
//! Variants — CPU: `naive` (one thread, each weight byte converted as it is read) → `parallel`
//! (weight rows across cores, each row converted once for every row of A). CUDA: `naive` (a
//! thread per output, any shape and alignment) → `mma` (16-byte weight loads, int8 → 16-bit
//! without conversion instructions, tensor-core products, split-K across blocks where the weight
//! has few rows; k a multiple of 16 and 16-byte aligned rows). See kernels/w8a16.cu and
//! docs/w8a16.md.
//!
//! Scales are read where they live: the CPU path checks them (finite, non-zero); the GPU reads
//! them in the kernel (a check would cost a synchronisation per call), so a NaN or Inf scale
//! shows as NaN/Inf in D.

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

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "w8a16";
/// The activation (and output) dtypes.
pub const ACT: &[DType] = &[DType::BF16, DType::F16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: ACT, min_arch: None, constraints: "any shape", summary: "one thread; each weight byte converted as it is read, an fp32 dot product per output", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: ACT, min_arch: None, constraints: "any shape", summary: "weight rows across cores, each row converted once for every row of A", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: ACT, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a thread per output, the weight byte converted as it is read, no reuse", rank: 1 },
        VariantInfo {
            name: "mma",
            backend: Backend::Cuda,
            dtypes: ACT,
            min_arch: Some(Arch::SM80),
            constraints: "k a multiple of 16; A and W 16-byte aligned with row pitches of 16-byte multiples",
            summary: "W streamed by 16-byte loads once per 32 rows of A, int8 → 16-bit by byte permutes (no conversion instructions), mma.sync products, split-K over blocks when the weight has few rows",
            rank: 2,
        },
    ]
}

/// Options of one call. `Default`: the best variant, the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct W8a16Options {
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
    /// Rows of W, columns of D.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// Elements between rows of A, W and D.
    pub lda: usize,
    /// See `lda`.
    pub ldw: usize,
    /// See `lda`.
    pub ldd: usize,
    /// A's, D's and the bias's dtype.
    pub dtype: DType,
    /// A bias is added.
    pub bias: bool,
    /// The shared device.
    pub device: Device,
}

impl Problem {
    /// Dense operands (rows k, k and n elements apart), no bias.
    pub fn dense((m, n, k): (usize, usize, usize), dtype: DType, device: Device) -> Problem {
        Problem {
            m,
            n,
            k,
            lda: k,
            ldw: k,
            ldd: n,
            dtype,
            bias: false,
            device,
        }
    }
    /// `m×n×k dtype` for labels.
    pub fn label(&self) -> String {
        format!("{}×{}×{} {}×i8", self.m, self.n, self.k, self.dtype)
    }
    /// Multiply-adds × 2.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// The bytes any implementation moves: the weight and its scales, A, D.
    pub fn min_bytes(&self) -> f64 {
        let es = self.dtype.size_in_bytes() as f64;
        (self.n * self.k + 4 * self.n) as f64 + es * (self.m * self.k + self.m * self.n) as f64
    }
}

fn validate(
    a: &Tensor,
    w: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<Problem> {
    if !ACT.contains(&a.dtype()) {
        return Err(Error::bad_arg(OP, "a", "a bf16 or f16 tensor", describe(a)));
    }
    if w.dtype() != DType::I8 {
        return Err(Error::bad_arg(
            OP,
            "w",
            "an int8 tensor (quantize_int8 makes one)",
            describe(w),
        ));
    }
    let (m, k, lda) = a.matrix_rows(OP, "a", "[m, k]")?;
    let (n, kw, ldw) = w.matrix_rows(OP, "w", "[n, k] (a linear layer's weight layout)")?;
    if kw != k {
        return Err(Error::bad_arg(
            OP,
            "w",
            format!("[n, {k}] (k as in a: {})", describe(a)),
            describe(w),
        ));
    }
    if scale.dtype() != DType::F32 || !scale.is_contiguous() || scale.shape() != [n] {
        return Err(Error::bad_arg(
            OP,
            "scale",
            format!("a contiguous f32 tensor of shape [{n}] (one scale per row of w)"),
            describe(scale),
        ));
    }
    if out.dtype() != a.dtype() || out.shape() != [m, n] {
        return Err(Error::bad_arg(
            OP,
            "out",
            format!("a {} tensor of shape [{m}, {n}] (a's dtype)", a.dtype()),
            describe(out),
        ));
    }
    let (_, _, ldd) = out.matrix_rows(OP, "out", "[m, n]")?;
    if let Some(b) = bias {
        if b.dtype() != a.dtype() || b.shape() != [n] || !b.is_contiguous() {
            return Err(Error::bad_arg(
                OP,
                "bias",
                format!("a contiguous [{n}] tensor of a's dtype ({})", a.dtype()),
                describe(b),
            ));
        }
    }
    let device = out.device();
    let ins = [("a", a), ("w", w), ("scale", scale)];
    out.expect_output_of(OP, ins.iter().copied().chain(bias.map(|t| ("bias", t))))?;
    Ok(Problem {
        m,
        n,
        k,
        lda,
        ldw,
        ldd,
        dtype: a.dtype(),
        bias: bias.is_some(),
        device,
    })
}

/// Why `mma` cannot run `p` with operands at `ptrs` ([a, w]; empty: alignment not known yet)
/// (None: it can).
pub fn mma_declines(p: &Problem, ptrs: &[u64]) -> Option<String> {
    if !p.k.is_multiple_of(16) {
        return Some(format!(
            "needs k a multiple of 16 (16-byte weight loads); k = {}",
            p.k
        ));
    }
    let es = p.dtype.size_in_bytes();
    for (name, pitch, ptr) in [("a", p.lda * es, ptrs.first()), ("w", p.ldw, ptrs.get(1))] {
        if !pitch.is_multiple_of(16) || ptr.is_some_and(|q| !q.is_multiple_of(16)) {
            return Some(format!(
                "needs `{name}` 16-byte aligned with a row pitch of a multiple of 16 bytes; it has {pitch} bytes"
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
        p.dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda && v.name == "mma")
                .then(|| mma_declines(p, ptrs))
                .flatten()
        },
    )?;
    Ok(v.name)
}

/// D = a·(scale ⊙ w)ᵀ (+ bias) into a caller-provided `out` (see the module docs for the
/// shapes).
pub fn w8a16_into(
    a: &Tensor,
    w: &Tensor,
    scale: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    opts: &W8a16Options,
) -> Result<()> {
    let p = validate(a, w, scale, bias, out)?;
    let ptrs = if p.device.is_cuda() {
        vec![a.device_ptr()?, w.device_ptr()?]
    } else {
        vec![]
    };
    let v = select(&p, opts.variant.as_deref(), &ptrs)?;
    match p.device {
        Device::Cpu => cpu::run(v, &p, a, w, scale, bias, out),
        Device::Cuda(_) => cuda::run(v, &p, a, w, scale, bias, out, opts),
    }
}

/// D = a·(scale ⊙ w)ᵀ (+ bias) as a new `[m, n]` tensor of a's dtype, with the best variant.
///
/// ```rust
/// use ferrite::{DType, Device, Tensor};
/// use ferrite::ops::w8a16::{quantize_int8, w8a16};
/// let w = Tensor::from_vec(vec![0.5f32, -1.0, 0.25, 2.0], &[2, 2])?;
/// let (w8, s) = quantize_int8(&w)?;
/// let a = Tensor::from_vec(vec![2.0f32, 1.0], &[1, 2])?.to_dtype(DType::BF16)?;
/// let d = w8a16(&a, &w8, &s, None)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
/// assert!((d[0] - 0.0).abs() < 0.02 && (d[1] - 2.5).abs() < 0.02);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn w8a16(a: &Tensor, w: &Tensor, scale: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (m, n) = (
        a.shape().first().copied().unwrap_or(0),
        w.shape().first().copied().unwrap_or(0),
    );
    let out = Tensor::empty(&[m, n], a.dtype(), a.device())?;
    w8a16_into(a, w, scale, bias, &out, &W8a16Options::default())?;
    Ok(out)
}

/// Symmetric per-output-channel int8 quantisation of a float weight `[n, k]` (any float dtype,
/// any device; computed on the host, results on the weight's device): `s[j] = max_p |w[j][p]| /
/// 127` (1 for an all-zero row) and `w₈[j][p] = round(w[j][p] / s[j])` (half away from zero, in
/// −127…127). Returns (w₈ `[n, k]` int8, s `[n]` f32). A non-finite weight is an error.
pub fn quantize_int8(w: &Tensor) -> Result<(Tensor, Tensor)> {
    if !w.dtype().is_float() || w.rank() != 2 {
        return Err(Error::bad_arg(
            "quantize_int8",
            "w",
            "a rank-2 float tensor [n, k]",
            describe(w),
        ));
    }
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let v = w.to_f32_vec()?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::bad_arg(
            "quantize_int8",
            "w",
            "finite values",
            format!("{} at row {}, column {}", v[i], i / k.max(1), i % k.max(1)),
        ));
    }
    let (q, s) = cpu::quantize_rows(&v, n, k);
    let q = Tensor::from_vec(q, &[n, k])?;
    let s = Tensor::from_vec(s, &[n])?;
    Ok((q.to_device(w.device())?, s.to_device(w.device())?))
}

/// The family as the harness sees it (check, bench, kernels).
pub struct W8a16;

impl OpFamily for W8a16 {
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
        vec!["cublas_bf16", "ferrite_bf16"]
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
