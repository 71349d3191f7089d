//! FP8 quantisation, the step before a scaled GEMM: `q = fp8(x · s)` with `s` per tensor or per
//! row, either given (delayed scaling: from an amax history) or computed from the data (current
//! scaling: `s = FMAX / amax`, the largest |x| landing on the format's largest finite value), and
//! `amax = max |x|` (for the history) and `inv_scale = 1 / s` (what [`scaled_mm`](super::scaled_mm)
//! takes as `scale_a` / `scale_b`) returned beside the codes.
//!
//! Rounding is round-to-nearest-even with saturation to the largest finite value (PTX
//! `cvt.rn.satfinite`, [`Fp8Format::encode`]). `s` is 1 where amax is 0 and NaN where amax is
//! not finite: an inf or NaN in x turns its tensor's (row's) codes into NaN, never into a
//! silently saturated tensor. The CPU and the GPU compute every f32 step the same way (the
//! division and the product each rounded once), so their codes agree bit for bit.
//!
//! CUDA (kernels/quantize.cu, sm_89+): one pass for amax (a warp per row, or a grid-wide max by
//! `atomicMax` on the float's bits), one for the codes (two elements per thread, one `cvt`).

use super::OP;
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::fp8::{Fp8Format, F8E4M3, F8E5M2};
use crate::core::harness::KernelSpec;
use crate::core::tensor::{describe, Tensor};
use crate::kernel_source;

const SRC: KernelSource = kernel_source!("scaled_mm", "kernels/quantize.cu");

/// The quantisation's name in errors.
pub const QUANTIZE_OP: &str = "quantize_fp8";

/// Input dtypes the quantisation reads.
pub const QUANTIZE_INPUTS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// Where a quantisation runs: the stream (CUDA; default: the device's own).
#[derive(Clone, Default)]
pub struct QuantizeOptions {
    /// The CUDA stream to queue on (None: the device's own).
    pub stream: Option<Stream>,
}

/// A checked quantisation: `rows × cols` elements, per-row scales or one.
#[derive(Clone, Copy, Debug)]
struct Quant {
    rows: usize,
    cols: usize,
    per_row: bool,
    fmt: Fp8Format,
    device: Device,
}

/// The tensors of one quantisation.
#[derive(Clone, Copy)]
struct Operands<'a> {
    x: &'a Tensor,
    scale: Option<&'a Tensor>,
    q: &'a Tensor,
    amax: &'a Tensor,
    inv_scale: &'a Tensor,
}

fn check_f32_vec(name: &str, t: &Tensor, count: usize, device: Device) -> Result<()> {
    if t.dtype() != DType::F32 || !t.is_contiguous() || t.numel() != count || t.device() != device {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            name,
            format!("a contiguous f32 tensor of {count} element(s) on {device}"),
            describe(t),
        ));
    }
    Ok(())
}

fn validate(o: Operands) -> Result<Quant> {
    let Operands {
        x,
        scale,
        q,
        amax,
        inv_scale,
    } = o;
    // An empty tensor's strides say nothing (torch gives [5, 0] strides [1, 1]): contiguous.
    let dense = |t: &Tensor| t.numel() == 0 || t.is_contiguous();
    if x.rank() != 2 || !dense(x) || !QUANTIZE_INPUTS.contains(&x.dtype()) {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "x",
            "a contiguous f32, f16 or bf16 tensor [rows, cols]",
            describe(x),
        ));
    }
    let (rows, cols) = (x.shape()[0], x.shape()[1]);
    let fmt = Fp8Format::of(q.dtype());
    let Some(fmt) = fmt.filter(|_| q.shape() == [rows, cols] && dense(q)) else {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "q",
            format!("a contiguous f8e4m3 or f8e5m2 tensor [{rows}, {cols}]"),
            describe(q),
        ));
    };
    let device = x.device();
    if q.device() != device {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "q",
            format!("a tensor on {device} (x's device)"),
            describe(q),
        ));
    }
    let per_row = amax.numel() == rows && rows != 1;
    if amax.numel() != 1 && !per_row {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "amax",
            format!("a contiguous f32 tensor of 1 element (per tensor) or {rows} (per row)"),
            describe(amax),
        ));
    }
    let count = if per_row { rows } else { 1 };
    check_f32_vec("amax", amax, count, device)?;
    check_f32_vec("inv_scale", inv_scale, count, device)?;
    if let Some(s) = scale {
        check_f32_vec("scale", s, count, device)?;
    }
    let outs = [("q", q), ("amax", amax), ("inv_scale", inv_scale)];
    for (i, (name, o)) in outs.iter().enumerate() {
        let others = outs.iter().map(|p| p.1).skip(i + 1);
        if o.shares_storage(x)
            || scale.is_some_and(|s| o.shares_storage(s))
            || others.into_iter().any(|p| o.shares_storage(p))
        {
            return Err(Error::bad_arg(
                QUANTIZE_OP,
                *name,
                "a buffer distinct from x, scale and the other outputs",
                "a view of one of them",
            ));
        }
    }
    Ok(Quant {
        rows,
        cols,
        per_row,
        fmt,
        device,
    })
}

/// The scale of a group whose largest magnitude is `amax`: `FMAX / amax` (rounded once), 1 for
/// an all-zero group, NaN for a non-finite amax.
pub fn scale_from_amax(fmt: Fp8Format, amax: f32) -> f32 {
    if amax == 0.0 {
        1.0
    } else if amax.is_finite() {
        fmt.max_finite() / amax
    } else {
        f32::NAN
    }
}

/// Quantises `x` `[rows, cols]` into `q` (f8e4m3 or f8e5m2, same shape), writing `amax` (max |x|)
/// and `inv_scale` (1 / s). Per-row when `amax` has `rows` elements (rows > 1), per tensor when it
/// has one; `inv_scale` and a given `scale` have as many. `scale = None`: current scaling,
/// `s = FMAX / amax`.
pub fn quantize_fp8_into(
    x: &Tensor,
    scale: Option<&Tensor>,
    q: &Tensor,
    amax: &Tensor,
    inv_scale: &Tensor,
    opts: &QuantizeOptions,
) -> Result<()> {
    let o = Operands {
        x,
        scale,
        q,
        amax,
        inv_scale,
    };
    let p = validate(o)?;
    match p.device {
        Device::Cpu => cpu(&p, o),
        Device::Cuda(_) => cuda(&p, o, opts),
    }
}

/// Current scaling of `x` `[rows, cols]` to `dtype` (f8e4m3 / f8e5m2), per row or per tensor:
/// `(q, inv_scale, amax)`, `inv_scale` ready to pass to [`scaled_mm`](super::scaled_mm).
///
/// ```rust
/// use ferrite::{DType, Tensor};
/// use ferrite::ops::scaled_mm::quantize::quantize_fp8;
/// let x = Tensor::from_vec(vec![1.0f32, -2.0, 0.5, 4.0], &[2, 2])?;
/// let (q, inv, amax) = quantize_fp8(&x, DType::F8E4M3, true)?;
/// assert_eq!(amax.to_vec::<f32>()?, vec![2.0, 4.0]);
/// // Row 0 scaled by 448 / 2: -2 lands on -448, e4m3's largest magnitude.
/// assert_eq!(q.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![224.0, -448.0, 56.0, 448.0]);
/// assert_eq!(inv.to_vec::<f32>()?, vec![1.0 / 224.0, 1.0 / 112.0]);
/// # Ok::<(), ferrite::Error>(())
/// ```
pub fn quantize_fp8(x: &Tensor, dtype: DType, per_row: bool) -> Result<(Tensor, Tensor, Tensor)> {
    if !dtype.is_fp8() {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "dtype",
            "f8e4m3 or f8e5m2",
            dtype,
        ));
    }
    let rows = x.shape().first().copied().unwrap_or(0);
    let count = if per_row { rows } else { 1 };
    let q = Tensor::empty(x.shape(), dtype, x.device())?;
    let amax = Tensor::empty(&[count], DType::F32, x.device())?;
    let inv = Tensor::empty(&[count], DType::F32, x.device())?;
    quantize_fp8_into(x, None, &q, &amax, &inv, &QuantizeOptions::default())?;
    Ok((q, inv, amax))
}

/// The CPU path: amax per group (NaN-propagating), the scales, then every element encoded.
fn cpu(p: &Quant, o: Operands) -> Result<()> {
    let Operands {
        x,
        scale,
        q,
        amax,
        inv_scale,
    } = o;
    let xs = x.to_f32_vec()?;
    let groups = if p.per_row { p.rows } else { 1 };
    let per_group = if p.per_row { p.cols } else { p.rows * p.cols };
    let mut am = vec![0f32; groups];
    for (g, m) in am.iter_mut().enumerate() {
        for &v in &xs[g * per_group..(g + 1) * per_group] {
            let a = v.abs();
            if a > *m || a.is_nan() {
                *m = a;
            }
            if m.is_nan() {
                break;
            }
        }
    }
    let s: Vec<f32> = match scale {
        Some(t) => t.to_f32_vec()?,
        None => am.iter().map(|&a| scale_from_amax(p.fmt, a)).collect(),
    };
    let codes: Vec<u8> = xs
        .iter()
        .enumerate()
        .map(|(i, &v)| p.fmt.encode(v * s[if p.per_row { i / p.cols } else { 0 }]))
        .collect();
    amax.write_f32(&am)?;
    inv_scale.write_f32(&s.iter().map(|&v| 1.0 / v).collect::<Vec<_>>())?;
    match q.dtype() {
        DType::F8E4M3 => q.with_cpu_mut::<F8E4M3, _>(|o| {
            for (d, c) in o.iter_mut().zip(&codes) {
                *d = F8E4M3(*c);
            }
        }),
        _ => q.with_cpu_mut::<F8E5M2, _>(|o| {
            for (d, c) in o.iter_mut().zip(&codes) {
                *d = F8E5M2(*c);
            }
        }),
    }
}

fn program(input: DType, fmt: DType) -> Program {
    Program::new(SRC)
        .define("FE_IN", input.cuda_name())
        .define("FE_E5M2", (fmt == DType::F8E5M2) as u32)
}

/// The quantisation modules (for `ferrite kernels`): every input dtype to either format.
pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for &i in QUANTIZE_INPUTS {
        for &f in super::FP8 {
            v.push(KernelSpec {
                program: program(i, f),
                functions: vec!["fp8_amax".into(), "fp8_quantize".into()],
                min_arch: Arch::SM89,
            });
        }
    }
    v
}

fn cuda(p: &Quant, o: Operands, opts: &QuantizeOptions) -> Result<()> {
    let Operands {
        x,
        scale,
        q,
        amax,
        inv_scale,
    } = o;
    let Device::Cuda(i) = p.device else {
        unreachable!("quantize_fp8's CUDA path on {}", p.device)
    };
    let dev = device(i)?;
    if dev.arch() < Arch::SM89 {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!(
                "{QUANTIZE_OP} on the GPU needs sm_89+ (the FP8 conversion), {} is sm_{}",
                dev.props().name,
                dev.arch().sm()
            ),
        });
    }
    let qp = q.device_ptr()?;
    if qp % 2 != 0 {
        return Err(Error::bad_arg(
            QUANTIZE_OP,
            "q",
            "a 2-byte-aligned buffer (codes are stored in pairs)",
            describe(q),
        ));
    }
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let prog = program(x.dtype(), q.dtype());
    let (amax_k, quant_k) = (
        dev.kernel(&prog, "fp8_amax")?,
        dev.kernel(&prog, "fp8_quantize")?,
    );
    let amax_p = amax.device_ptr()?;
    if !p.per_row {
        // SAFETY: amax is a live f32 tensor of one element on this device (validated), written
        // only by this stream's work.
        unsafe { dev.memset(amax_p, 0, 4, &stream)? };
    }
    let sms = dev.props().sm_count as u64;
    let blocks = |work: u64| work.div_ceil(256).clamp(1, sms * 8) as u32;
    let (rows, cols) = (p.rows as i64, p.cols as i64);
    let mut a = KernelArgs::new();
    a.push(x.device_ptr()?)
        .push(rows)
        .push(cols)
        .push(amax_p)
        .push(p.per_row as i32);
    let amax_work = if p.per_row {
        p.rows as u64 * 32
    } else {
        (p.rows * p.cols) as u64
    };
    amax_k.launch(&stream, (blocks(amax_work), 1, 1), (256, 1, 1), 0, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(x.device_ptr()?)
        .push(rows)
        .push(cols)
        .push(scale.map_or(Ok(0), |s| s.device_ptr())?)
        .push(amax_p)
        .push(p.per_row as i32)
        .push(qp)
        .push(inv_scale.device_ptr()?);
    let pairs = ((p.rows * p.cols) as u64).div_ceil(2).max(p.rows as u64);
    quant_k.launch(&stream, (blocks(pairs), 1, 1), (256, 1, 1), 0, &mut a)
}

#[cfg(test)]
#[path = "quantize_tests.rs"]
mod tests;
