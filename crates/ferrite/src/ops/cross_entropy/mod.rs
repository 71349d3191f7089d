//! # cross_entropy — softmax cross-entropy, forward and backward in one call
//!
//! logits `[N, V]` (f32, bf16, f16, contiguous), targets `[N]` class indices (i64 as torch, or
//! i32), `ignore_index` (default −100), label smoothing ε ∈ [0, 1), reduction mean (over the
//! non-ignored rows, as torch) / sum / none. Per row, in fp32 arithmetic:
//!
//! ```text
//! loss_i = logsumexp(x_i) − (1−ε)·x_{i,t_i} − (ε/V)·Σ_j x_ij        (0 for an ignored row)
//! dx_ij  = scale · (softmax(x_i)_j − (1−ε)·[j = t_i] − ε/V)         (0 for an ignored row)
//! scale  = dloss / #non-ignored rows (mean), dloss (sum, none)
//! ```
//!
//! Outputs: the per-row loss (f32 `[N]`), optionally the scalar loss (f32, one element: the mean
//! or sum; for `none`, the sum), and optionally the gradient dlogits (the logits' dtype), which
//! may be written **in place into the logits** ([`GradOut::InPlace`]): a training step that only
//! needs the gradient never holds the probabilities at all — the fused kernel recomputes them from
//! the logits in registers and overwrites each logit with its gradient, so the N×V activation
//! memory is reused instead of doubled (the trick Liger-Kernel uses for large vocabularies).
//! `dloss` is the incoming gradient of the scalar loss (1 for a plain `loss.backward()`); with
//! `none` every row's gradient is scaled by it (the gradient of dloss·Σ loss_i).
//!
//! Variants — CPU: `naive` (one thread, f64 sums) → `parallel` (rows across cores, same code).
//! CUDA: `naive` (unfused: log-softmax into an N×V f32 intermediate, then the loss, then the
//! gradient — three kernels, the row read five times) → `fused` (a block per row: one online
//! max/Σexp pass with 16-byte loads, one pass writing the gradient; the row read twice, nothing
//! materialised) → `resident` (fused with the row kept in shared memory between the passes, so
//! HBM sees each logit once). See kernels/cross_entropy.cu.
//!
//! ## Bad targets
//! A target neither equal to `ignore_index` nor in [0, V) is an error. On the CPU it is found
//! before any output is written. On the GPU the kernels never use it as an index: a first small
//! kernel records the first bad row and its value in device memory, the row's loss and gradient
//! are NaN, and after the launches the host reads those 32 bytes back (one small device→host
//! copy and a stream synchronisation per call) and returns `Error::BadArg` naming the row and
//! value. `check_targets: false` skips the read-back so the call stays asynchronous (needed for
//! CUDA-graph capture); a bad target then shows only as NaN in that row's loss and gradient (and
//! so in the scalar loss).

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

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "cross_entropy";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread, f64 sums, a row at a time", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "rows across cores (same arithmetic)", rank: 2 },
        VariantInfo { name: "simd", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "parallel, with the exponentials in f32 vectorised (core::cpu::exp_in_place, 16 lanes with AVX-512) instead of f64 exp", rank: 3 },
        VariantInfo {
            name: "naive",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "any shape; an N×V f32 intermediate",
            summary: "unfused: log-softmax into an N×V f32 tensor, then the loss, then the gradient (three kernels, scalar loads)",
            rank: 1,
        },
        VariantInfo {
            name: "fused",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "dlogits and logits at the same address mod 16 bytes (always so in place or for fresh allocations)",
            summary: "a block per row: online max/Σexp with 16-byte loads, then the gradient; two reads of the row, one write, no intermediate",
            rank: 2,
        },
        VariantInfo {
            name: "resident",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "as fused",
            summary: "fused with the row kept in shared memory between the passes (all of it up to ~113 KiB, else one block per SM with ~227 KiB of it): logits read from HBM once; ex2.approx, fewer instructions per element",
            rank: 3,
        },
        VariantInfo {
            name: "cluster",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM90),
            constraints: "as fused; rows up to 8 × ~227 KiB",
            summary: "resident with a row split over a cluster of 2/4/8 blocks (its share each in shared memory, partials exchanged through distributed shared memory): whole rows on chip at any LLM vocabulary, shares of ≥ 4 rows per SM overlapping their turnarounds",
            rank: 4,
        },
    ]
}

/// How the per-row losses are combined into the scalar (and so how the gradient is scaled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Σ loss_i / #non-ignored rows (NaN when every row is ignored, as torch).
    Mean,
    /// Σ loss_i.
    Sum,
    /// No reduction: the per-row losses are the result (the scalar output, if asked, is the sum).
    None,
}

impl Reduction {
    /// torch's name for it (`mean`, `sum`, `none`).
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Mean => "mean",
            Reduction::Sum => "sum",
            Reduction::None => "none",
        }
    }
}

/// Where the gradient dlogits goes.
#[derive(Clone, Copy, Debug)]
pub enum GradOut<'a> {
    /// Forward only.
    Skip,
    /// A caller-provided tensor like the logits (distinct storage).
    Into(&'a Tensor),
    /// Overwrite the logits with their gradient.
    InPlace,
}

/// Options of one call. `Default`: best variant, the device's own stream, torch's defaults
/// (`ignore_index` −100, no smoothing, mean), dloss 1, targets checked.
#[derive(Clone, Debug)]
pub struct CrossEntropyOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// Rows whose target equals this contribute no loss and get a zero gradient.
    pub ignore_index: i64,
    /// ε ∈ [0, 1): the target distribution is (1−ε)·one-hot + ε/V.
    pub label_smoothing: f32,
    /// How the scalar loss combines the rows, and so how the gradient is scaled.
    pub reduction: Reduction,
    /// Incoming gradient of the scalar loss; scales dlogits.
    pub dloss: f32,
    /// GPU: read the bad-target flag back after the launch (one small device→host copy and a
    /// synchronisation). Off: asynchronous, graph-capturable; a bad row's loss is NaN.
    pub check_targets: bool,
    /// CUDA `cluster`: the cluster size (2, 4 or 8 blocks per row); None: the rule of
    /// `cuda::cluster_geom`.
    pub cluster: Option<usize>,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions {
            variant: None,
            stream: None,
            ignore_index: -100,
            label_smoothing: 0.0,
            reduction: Reduction::Mean,
            dloss: 1.0,
            check_targets: true,
            cluster: None,
        }
    }
}

/// A validated problem.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// N: rows of logits.
    pub rows: usize,
    /// V: classes per row.
    pub vocab: usize,
    /// Elements from one row of the logits to the next (≥ vocab).
    pub ld: usize,
    /// The logits' (and gradient's) dtype.
    pub dtype: DType,
    /// The targets' dtype (i64 or i32).
    pub target_dtype: DType,
    /// The shared device.
    pub device: Device,
}

fn validate(
    logits: &Tensor,
    targets: &Tensor,
    loss_rows: &Tensor,
    loss: Option<&Tensor>,
    grad: GradOut,
    opts: &CrossEntropyOptions,
) -> Result<Problem> {
    if logits.rank() != 2
        || logits.strides()[1] != 1
        || logits.strides()[0] < logits.shape()[1]
        || !FLOATS.contains(&logits.dtype())
        || logits.numel() == 0
    {
        return Err(Error::bad_arg(
            OP,
            "logits",
            "an f32/f16/bf16 tensor [N, V] with N, V ≥ 1, rows contiguous (row stride ≥ V)",
            describe(logits),
        ));
    }
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let ld = logits.strides()[0];
    let dev = logits.device();
    if targets.shape() != [n]
        || !targets.is_contiguous()
        || !matches!(targets.dtype(), DType::I64 | DType::I32)
        || targets.device() != dev
    {
        return Err(Error::bad_arg(
            OP,
            "targets",
            format!("a contiguous i64 or i32 tensor [{n}] on {dev}"),
            describe(targets),
        ));
    }
    if let Some(c) = opts.cluster {
        if !cuda::CLUSTERS.contains(&c) {
            return Err(Error::bad_arg(
                OP,
                "cluster",
                format!("a cluster size in {:?} (or None)", cuda::CLUSTERS),
                c,
            ));
        }
    }
    let ls = opts.label_smoothing;
    if !(0.0..1.0).contains(&ls) {
        return Err(Error::bad_arg(
            OP,
            "label_smoothing",
            "a number in [0, 1)",
            ls,
        ));
    }
    if !opts.dloss.is_finite() {
        return Err(Error::bad_arg(OP, "dloss", "a finite number", opts.dloss));
    }
    let f32_out = |name: &str, t: &Tensor, want: &[usize]| -> Result<()> {
        let shape_ok = t.shape() == want || (want == [1] && t.numel() == 1);
        if !shape_ok || t.dtype() != DType::F32 || !t.is_contiguous() || t.device() != dev {
            return Err(Error::bad_arg(
                OP,
                name,
                format!("a contiguous f32 tensor {want:?} on {dev}"),
                describe(t),
            ));
        }
        if t.shares_storage(logits) || t.shares_storage(targets) {
            return Err(Error::bad_arg(
                OP,
                name,
                "a buffer distinct from the inputs",
                "a view of an input",
            ));
        }
        Ok(())
    };
    f32_out("loss_rows", loss_rows, &[n])?;
    if let Some(l) = loss {
        f32_out("loss", l, &[1])?;
        if l.shares_storage(loss_rows) {
            return Err(Error::bad_arg(
                OP,
                "loss",
                "a buffer distinct from `loss_rows`",
                "a view of `loss_rows`",
            ));
        }
    }
    if let GradOut::Into(g) = grad {
        if g.shape() != logits.shape()
            || g.dtype() != logits.dtype()
            || g.strides() != logits.strides()
            || g.device() != dev
        {
            return Err(Error::bad_arg(
                OP,
                "dlogits",
                format!(
                    "a tensor like `logits`, with its strides ({})",
                    describe(logits)
                ),
                describe(g),
            ));
        }
        let aliases = [logits, targets, loss_rows]
            .into_iter()
            .chain(loss)
            .any(|t| g.shares_storage(t));
        if aliases {
            return Err(Error::bad_arg(
                OP,
                "dlogits",
                "a buffer distinct from the inputs and losses (use GradOut::InPlace to overwrite the logits)",
                "a view of another argument",
            ));
        }
    }
    Ok(Problem {
        rows: n,
        vocab: v,
        ld,
        dtype: logits.dtype(),
        target_dtype: targets.dtype(),
        device: dev,
    })
}

/// Why `fused` (and `resident`) cannot take these buffers, if so: the gradient rows must split at the same
/// 16-byte boundaries as the logits rows. `ptrs` = [logits, dlogits] (dlogits 0 when none).
pub fn fused_unfit(ptrs: &[u64]) -> Option<String> {
    match ptrs {
        [x, g] if *g != 0 && x % 16 != g % 16 => Some(format!(
            "needs dlogits at the logits' address mod 16 bytes (logits ≡ {}, dlogits ≡ {})",
            x % 16,
            g % 16
        )),
        _ => None,
    }
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
            (v.backend == Backend::Cuda && matches!(v.name, "fused" | "resident" | "cluster"))
                .then(|| fused_unfit(ptrs))
                .flatten()
        },
    )?;
    if requested.is_none() && v.name == "cluster" {
        if let Device::Cuda(i) = p.device {
            // `resident` wherever one block keeps at least 7/8 of a row. H100, both with pass 1
            // by cp.async: V = 50257 bf16 (whole row) 94.1% of copy against
            // cluster's 90.4%; V = 128256 (88% of the row kept, the rest read twice) 90.5%
            // against cluster's 87.0-88.0%. Longer rows go to `cluster`, which keeps them whole
            // (before the cp.async pass 1, V = 128256 was 73.6% on resident, 78.8% on cluster).
            let dev = crate::core::cuda::device(i)?;
            let vectors = p.vocab / crate::core::cuda::rows::vec_width(p.dtype);
            if 8 * cuda::resident_geom(&dev, p).cap >= 7 * vectors {
                return Ok("resident");
            }
        }
    }
    Ok(v.name)
}

/// The error for target `value` at `row`.
pub fn bad_target(row: usize, value: i64, p: &Problem, ignore_index: i64) -> Error {
    Error::bad_arg(
        OP,
        "targets",
        format!(
            "class indices in [0, {}) or ignore_index ({ignore_index})",
            p.vocab
        ),
        format!("targets[{row}] = {value}"),
    )
}

/// Cross-entropy of `logits` against `targets` into caller-provided outputs: the per-row loss,
/// optionally the scalar loss, and the gradient as `grad` says.
pub fn cross_entropy_into(
    logits: &Tensor,
    targets: &Tensor,
    loss_rows: &Tensor,
    loss: Option<&Tensor>,
    grad: GradOut,
    opts: &CrossEntropyOptions,
) -> Result<()> {
    let p = validate(logits, targets, loss_rows, loss, grad, opts)?;
    let ptrs = if p.device.is_cuda() {
        let g = match grad {
            GradOut::Skip => 0,
            GradOut::Into(g) => g.device_ptr()?,
            GradOut::InPlace => logits.device_ptr()?,
        };
        vec![logits.device_ptr()?, g]
    } else {
        vec![]
    };
    let v = select(&p, opts.variant.as_deref(), &ptrs)?;
    match p.device {
        Device::Cpu => cpu::run(v, &p, logits, targets, loss_rows, loss, grad, opts),
        Device::Cuda(_) => cuda::run(v, &p, logits, targets, loss_rows, loss, grad, opts),
    }
}

/// `grad *= dloss` in place: the loss's incoming gradient folded into a dlogits computed by
/// [`cross_entropy_into`] with `dloss = 1` before that gradient was known (autograd's order).
/// grad: contiguous `[N, V]` (or `[V]`); dloss: one element (`mean`/`sum`) or `[N]` (`none`),
/// in grad's dtype and on its device. On the GPU dloss is read by the kernel (no host sync) and
/// a scalar 1 costs no pass over grad.
pub fn scale_grad_in_place(grad: &Tensor, dloss: &Tensor, stream: Option<Stream>) -> Result<()> {
    const OPN: &str = "cross_entropy_scale_grad";
    // Contiguous, or on the GPU 2-D rows further apart than their length (dlogits in padded
    // rows, as the logits of a classifier whose width is not a multiple of 16 bytes).
    let rows_strided = grad.rank() == 2
        && grad.device().is_cuda()
        && grad.strides()[1] == 1
        && grad.strides()[0] >= grad.shape()[1];
    if !FLOATS.contains(&grad.dtype())
        || !(grad.is_contiguous() || rows_strided)
        || grad.rank() == 0
        || grad.rank() > 2
    {
        return Err(Error::bad_arg(
            OPN,
            "grad",
            "a contiguous f32/f16/bf16 tensor [N, V] or [V] (on the GPU also [N, V] with a row stride ≥ V)",
            describe(grad),
        ));
    }
    let cols = *grad.shape().last().unwrap();
    let rows = if grad.rank() == 2 { grad.shape()[0] } else { 1 };
    if dloss.dtype() != grad.dtype()
        || dloss.device() != grad.device()
        || !dloss.is_contiguous()
        || (dloss.numel() != 1 && (grad.rank() != 2 || dloss.numel() != rows))
    {
        return Err(Error::bad_arg(
            OPN,
            "dloss",
            format!(
                "one {} element, or one per row ([{rows}]), on {}",
                grad.dtype(),
                grad.device()
            ),
            describe(dloss),
        ));
    }
    if rows * cols == 0 {
        return Ok(());
    }
    match grad.device() {
        Device::Cpu => {
            let s = dloss.to_f32_vec()?;
            if s.len() == 1 && s[0] == 1.0 {
                return Ok(());
            }
            let mut g = grad.to_f32_vec()?;
            for (r, row) in g.chunks_mut(cols).enumerate() {
                let k = s[if s.len() == 1 { 0 } else { r }];
                row.iter_mut().for_each(|v| *v *= k);
            }
            grad.write_f32(&g)
        }
        Device::Cuda(_) => {
            let ld = if grad.rank() == 2 && rows > 1 {
                grad.strides()[0]
            } else {
                cols
            };
            cuda::scale_grad(grad, dloss, (rows, cols, ld), stream)
        }
    }
}

/// Allocating convenience: (per-row loss `[N]`, scalar loss `[1]`, dlogits like the logits).
///
/// ```rust
/// use ferrite::ops::cross_entropy::{cross_entropy, CrossEntropyOptions};
/// use ferrite::Tensor;
/// let logits = Tensor::from_vec(vec![0.0f32; 8], &[2, 4])?; // uniform over 4 classes
/// let targets = Tensor::from_vec(vec![1i64, -100], &[2])?; // the second row is ignored
/// let (_rows, loss, dlogits) = cross_entropy(&logits, &targets, &CrossEntropyOptions::default())?;
/// assert!((loss.to_vec::<f32>()?[0] - 4f32.ln()).abs() < 1e-6);
/// assert_eq!(dlogits.to_vec::<f32>()?[..4], [0.25, -0.75, 0.25, 0.25]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    opts: &CrossEntropyOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let n = logits.shape().first().copied().unwrap_or(0);
    let d = logits.device();
    let loss_rows = Tensor::empty(&[n], DType::F32, d)?;
    let loss = Tensor::empty(&[1], DType::F32, d)?;
    let g = Tensor::empty(logits.shape(), logits.dtype(), d)?;
    cross_entropy_into(
        logits,
        targets,
        &loss_rows,
        Some(&loss),
        GradOut::Into(&g),
        opts,
    )?;
    Ok((loss_rows, loss, g))
}

/// The family as the harness sees it (check, bench, kernels).
pub struct CrossEntropy;

impl OpFamily for CrossEntropy {
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
