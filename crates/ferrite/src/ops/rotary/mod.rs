//! # rotary — rotary position embeddings (RoPE), flash-attn's `apply_rotary_emb`
//!
//! out = x with each pair of its first R dims rotated by the angle of the token's position:
//! `o0 = x0·cos − x1·sin`, `o1 = x1·cos + x0·sin`, cos/sin read from tables `[S_ro, R/2]` at the
//! position `s + offset`. Pairs are `(i, i + R/2)` ("rotate half": GPT-NeoX, Llama, the default)
//! or `(2i, 2i + 1)` (`interleaved`: GPT-J). `conjugate` rotates the other way (sin negated):
//! that is the backward, since a rotation's transpose is its inverse. Dims past R are copied.
//!
//! x and out: `[B, S, H, D]`, or `[T, H, D]` with `cu_seqlens` (int32 `[B+1]`, sequences packed
//! along T), one float dtype; the head dim contiguous and the other strides free, so q and k can
//! be views of a packed QKV projection. out may be x itself (in place) or a buffer of its own.
//! Offsets: one for every sequence (`offset`, a decode step's cache length) or int32 `[B]`
//! (`offsets`, per sequence). A position outside `[0, S_ro)` is an error when the host can see it
//! (a scalar offset on padded input; every case on the CPU); on the GPU with device-side offsets
//! or cu_seqlens, such a token's rotated dims come out NaN — never a read past the tables.
//!
//! Variants — CPU: `naive` (one thread) → `parallel` (tokens across cores). CUDA: `naive` (a
//! thread per pair, scalar loads) → `vectorized` (16-byte loads and stores). See
//! kernels/rotary.cu.

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
pub const OP: &str = "rotary";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread, a pair at a time", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "tokens across cores", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a thread per pair, scalar loads", rank: 1 },
        VariantInfo {
            name: "vectorized",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(Arch::SM80),
            constraints: "R/2 (or R, interleaved) and D − R multiples of 16 bytes; 16-byte aligned tensors and strides",
            summary: "a thread per 16 bytes: both halves of its pairs by 16-byte loads and stores",
            rank: 2,
        },
    ]
}

/// Options of one call. `Default`: best variant, rotate-half pairs, forward rotation, offset 0,
/// padded `[B, S, H, D]` input, the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct RotaryOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Pairs `(2i, 2i + 1)` (GPT-J) instead of `(i, i + R/2)`.
    pub interleaved: bool,
    /// The inverse rotation (sin negated): the backward.
    pub conjugate: bool,
    /// Added to every token's position (used when `offsets` is None).
    pub offset: usize,
    /// int32 `[B]`: each sequence's offset, on x's device.
    pub offsets: Option<Tensor>,
    /// int32 `[B+1]`: x is `[T, H, D]` with sequence b's tokens at rows `cu[b]..cu[b+1]`.
    pub cu_seqlens: Option<Tensor>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

/// A rotary call's sizes and strides (elements).
#[derive(Clone, Debug)]
pub struct Problem {
    /// The dtype of x and out.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
    /// Token rows: B·S, or T when packed.
    pub tokens: usize,
    /// Sequences.
    pub batch: usize,
    /// S (padded), or T (packed).
    pub seqlen: usize,
    /// H: heads per token.
    pub heads: usize,
    /// D: the head dim.
    pub dim: usize,
    /// R/2: the pairs per head.
    pub half: usize,
    /// S_ro: rows of the tables.
    pub ro_len: usize,
    /// x's (batch, token, head) strides; batch is 0 when packed.
    pub xs: [usize; 3],
    /// out's.
    pub os: [usize; 3],
    /// out is x itself.
    pub in_place: bool,
    /// x is `[T, H, D]` with `cu_seqlens`.
    pub packed: bool,
}

fn float_of(op: &str, name: &str, t: &Tensor, what: &str) -> Result<()> {
    if !FLOATS.contains(&t.dtype()) {
        return Err(Error::bad_arg(op, name, what, describe(t)));
    }
    Ok(())
}

fn int_vector(op: &str, name: &str, t: &Tensor, len: usize, x: &Tensor) -> Result<()> {
    if t.dtype() != DType::I32
        || t.shape() != [len]
        || !t.is_contiguous()
        || t.device() != x.device()
    {
        return Err(Error::bad_arg(
            op,
            name,
            format!("a contiguous int32 tensor [{len}] on {}", x.device()),
            describe(t),
        ));
    }
    Ok(())
}

/// Checks the call and returns its problem.
pub fn validate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    out: &Tensor,
    o: &RotaryOptions,
) -> Result<Problem> {
    let op = OP;
    let packed = o.cu_seqlens.is_some();
    let rank = if packed { 3 } else { 4 };
    let what = if packed {
        "an f32/f16/bf16 tensor [T, H, D] (packed by cu_seqlens) with a contiguous last dim"
    } else {
        "an f32/f16/bf16 tensor [B, S, H, D] with a contiguous last dim"
    };
    float_of(op, "x", x, what)?;
    if x.rank() != rank || x.strides()[rank - 1] != 1 || x.shape()[rank - 1] == 0 {
        return Err(Error::bad_arg(op, "x", what, describe(x)));
    }
    if out.shape() != x.shape()
        || out.dtype() != x.dtype()
        || out.device() != x.device()
        || out.strides()[rank - 1] != 1
    {
        return Err(Error::bad_arg(
            op,
            "out",
            format!(
                "a tensor like `x` ({}) with a contiguous last dim",
                describe(x)
            ),
            describe(out),
        ));
    }
    let in_place = out.shares_storage(x);
    if in_place && (out.layout().offset() != x.layout().offset() || out.strides() != x.strides()) {
        return Err(Error::bad_arg(
            op,
            "out",
            "x itself (in place) or a buffer of its own",
            "a different view of x's storage",
        ));
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.rank() != 2
            || !t.is_contiguous()
            || t.dtype() != x.dtype()
            || t.device() != x.device()
            || t.shape() != cos.shape()
        {
            return Err(Error::bad_arg(
                op,
                name,
                format!(
                    "a contiguous {} table [S_ro, R/2] on {} (sin like cos: {})",
                    x.dtype(),
                    x.device(),
                    describe(cos)
                ),
                describe(t),
            ));
        }
    }
    let dim = x.shape()[rank - 1];
    let (ro_len, half) = (cos.shape()[0], cos.shape()[1]);
    if half == 0 || 2 * half > dim {
        return Err(Error::bad_arg(
            op,
            "cos",
            format!("[S_ro, R/2] with 1 ≤ R/2 and R ≤ the head dim {dim}"),
            describe(cos),
        ));
    }
    let st = x.strides();
    let ost = out.strides();
    let (batch, seqlen, tokens, heads, xs, os) = if let Some(cu) = &o.cu_seqlens {
        if cu.rank() != 1 || cu.shape()[0] < 2 {
            return Err(Error::bad_arg(
                op,
                "cu_seqlens",
                "an int32 tensor [B+1] with B ≥ 1",
                describe(cu),
            ));
        }
        let b = cu.shape()[0] - 1;
        int_vector(op, "cu_seqlens", cu, b + 1, x)?;
        let t = x.shape()[0];
        (
            b,
            t,
            t,
            x.shape()[1],
            [0, st[0], st[1]],
            [0, ost[0], ost[1]],
        )
    } else {
        let (b, s) = (x.shape()[0], x.shape()[1]);
        (
            b,
            s,
            b * s,
            x.shape()[2],
            [st[0], st[1], st[2]],
            [ost[0], ost[1], ost[2]],
        )
    };
    if let Some(off) = &o.offsets {
        int_vector(op, "offsets", off, batch, x)?;
    } else if !packed && seqlen > 0 && seqlen + o.offset > ro_len {
        return Err(Error::bad_arg(
            op,
            "cos",
            format!(
                "a table of at least S + offset = {} + {} = {} positions",
                seqlen,
                o.offset,
                seqlen + o.offset
            ),
            describe(cos),
        ));
    }
    if o.offset > i32::MAX as usize {
        return Err(Error::bad_arg(
            op,
            "offset",
            "a position offset below 2³¹",
            o.offset,
        ));
    }
    Ok(Problem {
        dtype: x.dtype(),
        device: x.device(),
        tokens,
        batch,
        seqlen,
        heads,
        dim,
        half,
        ro_len,
        xs,
        os,
        in_place,
        packed,
    })
}

/// Why the vectorized kernel cannot take this call, if so (`ptrs`: x, out, cos, sin).
pub fn vectorized_unfit(p: &Problem, interleaved: bool, ptrs: &[u64]) -> Option<String> {
    let vec = 16 / p.dtype.size_in_bytes();
    let rot = if interleaved { 2 * p.half } else { p.half };
    if !rot.is_multiple_of(vec) {
        let what = if interleaved { "R" } else { "R/2" };
        return Some(format!(
            "needs {what} a multiple of {vec} for {} (got {rot})",
            p.dtype
        ));
    }
    if !p.in_place && !(p.dim - 2 * p.half).is_multiple_of(vec) {
        return Some(format!(
            "needs D − R a multiple of {vec} (got {})",
            p.dim - 2 * p.half
        ));
    }
    if p.xs.iter().chain(&p.os).any(|s| !s.is_multiple_of(vec)) {
        return Some(format!(
            "needs strides that are multiples of {vec} elements"
        ));
    }
    if ptrs.iter().any(|a| a % 16 != 0) {
        return Some("needs 16-byte aligned tensors".into());
    }
    None
}

fn select(p: &Problem, o: &RotaryOptions, ptrs: &[u64]) -> Result<&'static str> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        OP,
        &vs,
        o.variant.as_deref(),
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            (v.backend == Backend::Cuda && v.name == "vectorized")
                .then(|| vectorized_unfit(p, o.interleaved, ptrs))
                .flatten()
        },
    )?;
    Ok(v.name)
}

/// out = rotary(x) (out may be x: in place).
pub fn rotary_into(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    out: &Tensor,
    opts: &RotaryOptions,
) -> Result<()> {
    let p = validate(x, cos, sin, out, opts)?;
    if p.tokens == 0 || p.heads == 0 {
        return Ok(());
    }
    match p.device {
        Device::Cpu => {
            let v = select(&p, opts, &[])?;
            cpu::rotary(v, &p, x, cos, sin, out, opts)
        }
        Device::Cuda(_) => {
            let ptrs = [
                x.device_ptr()?,
                out.device_ptr()?,
                cos.device_ptr()?,
                sin.device_ptr()?,
            ];
            let v = select(&p, opts, &ptrs)?;
            cuda::rotary(v, &p, x, cos, sin, out, opts)
        }
    }
}

/// A new tensor: x rotated (contiguous, like x).
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RotaryOptions) -> Result<Tensor> {
    let out = Tensor::empty(x.shape(), x.dtype(), x.device())?;
    rotary_into(x, cos, sin, &out, opts)?;
    Ok(out)
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Rotary;

impl OpFamily for Rotary {
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
    fn bench_takes_size(&self) -> bool {
        false
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
