//! `ferrite._native`: ferrite's ops for the Python package `ferrite` (python/ferrite).
//!
//! The functions here take tensors as plain descriptors built by the Python layer from torch
//! tensors — `(data_ptr, shape, strides, dtype)` with strides in elements and dtype a name such
//! as `"float32"` — plus the device index (-1 for the CPU) and, for CUDA, the raw `CUstream` of
//! `torch.cuda.current_stream().cuda_stream`. There is no torch dependency on this side.
//!
//! **Trust boundary.** A descriptor's pointer cannot be checked from here: the Python layer
//! (python/ferrite/_ops.py) builds every descriptor from a live torch tensor that it keeps alive
//! for the call, and allocates every output itself. Everything else — shapes, strides, dtypes,
//! devices, sizes — is checked by ferrite, and any failure (a panic included) comes back as a
//! Python exception: `ValueError` for a bad argument, `RuntimeError` otherwise.
//!
//! **CUDA**: each descriptor is wrapped with `Tensor::from_device_ptr` (borrowed memory, never
//! freed by ferrite) and the op runs on torch's stream (`CudaDevice::wrap_stream`): no copy, no
//! synchronisation, outputs written straight into the torch-allocated tensors, so the caching
//! allocator and CUDA-graph capture see ordinary stream-ordered work.
//!
//! **CPU**: borrowed in place where that is sound, copied otherwise. An operand whose data
//! pointer is 8-byte aligned (ferrite's CPU code may view host bytes as any element type) and
//! whose span (every byte its layout addresses) overlaps no operand wrapped before it in the same
//! call is wrapped with `Tensor::from_host_ptr`: the op reads and writes torch's memory directly,
//! no copy. Otherwise (an unaligned view, or a span shared with another operand — the same tensor
//! passed twice, an output aliasing an input) the span is copied into a ferrite tensor viewed with
//! the same strides and, for an output, copied back after the op, so two borrowed tensors never
//! cover the same bytes (their separate locks could otherwise hand out aliasing `&mut`s) and the
//! results are those of copy-in / copy-out semantics.

mod attn;
mod fp8;
mod fused;
mod moe;
mod train;

use ferrite::core::borrow::{opt_ref, write_back_all, Borrowed as Operand, HostBorrows};
use ferrite::core::cuda::{self as fcuda, CudaDevice, Stream};
use ferrite::core::harness::Precision;
use ferrite::ops::matmul::{self as fmatmul, MatmulOptions};
use ferrite::ops::norm::{self as fnorm, Bwd, BwdOut, Fwd, FwdOut, NormKind, NormOptions};
use ferrite::{DType, Error, Tensor};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// A tensor as the Python layer describes it: (data pointer, shape, strides in elements, dtype).
type Desc = (u64, Vec<usize>, Vec<usize>, String);

/// Where the op runs: the CPU (with the host spans borrowed so far in this call), or a GPU and
/// the stream to run on.
#[derive(Clone)]
enum Target {
    Cpu(Arc<Mutex<HostBorrows>>),
    Cuda(Arc<CudaDevice>, Stream),
}

impl Target {
    fn stream(&self) -> Option<Stream> {
        match self {
            Target::Cpu(_) => None,
            Target::Cuda(_, s) => Some(s.clone()),
        }
    }
}

fn target(op: &str, device: i64, stream: u64) -> ferrite::Result<Target> {
    if device < 0 {
        return Ok(Target::Cpu(Arc::default()));
    }
    let dev = fcuda::device(device as usize).map_err(|e| match e {
        Error::BadArg { expected, got, .. } => {
            Error::bad_arg(op, "device", format!("a CUDA device index {expected}"), got)
        }
        other => other,
    })?;
    // SAFETY: `stream` is torch's current stream on this device (the Python layer reads it from
    // `torch.cuda.current_stream(device).cuda_stream` right before the call; 0 is the legacy
    // default stream). torch never destroys its streams while the process runs, and the handle
    // is dropped when this call returns; ferrite never destroys a borrowed stream.
    let s = unsafe { dev.wrap_stream(stream)? };
    Ok(Target::Cuda(dev, s))
}

fn parse_dtype(op: &str, arg: &str, name: &str) -> ferrite::Result<DType> {
    let n = name.strip_prefix("torch.").unwrap_or(name);
    DType::parse(n).ok_or_else(|| {
        Error::bad_arg(
            op,
            arg,
            "dtype float32, float16 or bfloat16 (or int32/int8/uint8/uint16/uint32, float8_e4m3fn/float8_e5m2)",
            n,
        )
    })
}

/// Wraps a descriptor on `tgt`. `op`/`arg` name it in errors.
fn wrap(op: &str, arg: &str, d: &Desc, tgt: &Target) -> ferrite::Result<Operand> {
    let (ptr, shape, strides, dtype) = d;
    let dtype = parse_dtype(op, arg, dtype)?;
    if shape.len() != strides.len() {
        return Err(Error::bad_arg(
            op,
            arg,
            format!("one stride per dim of shape {shape:?}"),
            format!("strides {strides:?}"),
        ));
    }
    if !shape.contains(&0) && *ptr == 0 {
        return Err(Error::bad_arg(
            op,
            arg,
            "a non-null data pointer",
            "a null pointer",
        ));
    }
    match tgt {
        Target::Cuda(dev, _) => {
            // SAFETY: the Python layer built this descriptor from a live torch CUDA tensor on
            // this device (checked there: same device index as every other operand), kept alive
            // by the caller for the whole call; its shape and strides address only its storage.
            let t = unsafe { Tensor::from_device_ptr(dev.clone(), *ptr, shape, strides, dtype)? };
            Ok(Operand::direct(t))
        }
        Target::Cpu(borrows) => {
            let mut borrows = borrows
                .lock()
                .map_err(|_| Error::Other(format!("{op}: operand list lock poisoned")))?;
            // SAFETY: the Python layer built this descriptor from a live torch CPU tensor, kept
            // alive (and not touched by Python) for the whole call, whose layout addresses the
            // bytes the view spans from `ptr`; every operand is dropped before the call returns.
            unsafe { borrows.wrap(op, arg, *ptr, shape, strides, dtype) }
        }
    }
}

fn wrap_opt(
    op: &str,
    arg: &str,
    d: &Option<Desc>,
    tgt: &Target,
) -> ferrite::Result<Option<Operand>> {
    d.as_ref().map(|d| wrap(op, arg, d, tgt)).transpose()
}

/// Runs `f` without the GIL, turning a ferrite error into `ValueError` (a bad argument) or
/// `RuntimeError` (anything else) and a panic into `RuntimeError`.
fn run<F>(py: Python<'_>, op: &str, f: F) -> PyResult<()>
where
    F: FnOnce() -> ferrite::Result<()> + Send,
{
    run_value(py, op, f)
}

/// `run` for a call that returns a value.
fn run_value<T, F>(py: Python<'_>, op: &str, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> ferrite::Result<T> + Send,
{
    let r = py.detach(move || catch_unwind(AssertUnwindSafe(f)));
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(e)),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(PyRuntimeError::new_err(format!(
                "{op}: internal error in ferrite (a Rust panic): {msg}"
            )))
        }
    }
}

fn to_py(e: Error) -> PyErr {
    match e {
        Error::BadArg { .. } | Error::Overflow { .. } | Error::NoVariant { .. } => {
            PyValueError::new_err(e.to_string())
        }
        Error::HostMemory { .. } => PyMemoryError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// out = alpha·a·b + beta·out (ferrite's `matmul_into`). a: [m, k] or [batch, m, k], b: [k, n]
/// or [batch, k, n] (row-major or transposed views), out: [m, n] / [batch, m, n] row-major.
/// `tf32`: let f32 inputs run on tensor cores as tf32 (CUDA). `variant`: a named variant, or the
/// best that fits.
#[pyfunction]
#[pyo3(signature = (a, b, out, alpha=1.0, beta=0.0, tf32=false, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
fn matmul(
    py: Python<'_>,
    a: Desc,
    b: Desc,
    out: Desc,
    alpha: f32,
    beta: f32,
    tf32: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.matmul";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let a = wrap(OP, "a", &a, &tgt)?;
        let b = wrap(OP, "b", &b, &tgt)?;
        let out = wrap(OP, "out", &out, &tgt)?;
        let opts = MatmulOptions {
            variant,
            alpha,
            beta,
            precision: if tf32 {
                Precision::Tf32
            } else {
                Precision::F32
            },
            stream: tgt.stream(),
            threads: 0,
            config: None,
        };
        fmatmul::matmul_into(&a.t, &b.t, &out.t, &opts)?;
        out.write_back()
    })
}

fn norm_kind(op: &str, kind: &str) -> ferrite::Result<NormKind> {
    match kind {
        "layer_norm" => Ok(NormKind::Layer),
        "rms_norm" => Ok(NormKind::Rms),
        other => Err(Error::bad_arg(op, "kind", "layer_norm or rms_norm", other)),
    }
}

/// Norm forward into caller-provided outputs (ferrite's `norm::forward_into`): y, and h = x +
/// residual when a residual is given; mean (LayerNorm) and rstd are f32, one per row.
#[pyfunction]
#[pyo3(signature = (kind, x, y, residual=None, weight=None, bias=None, h=None, mean=None, rstd=None, eps=1e-5, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
fn norm_forward(
    py: Python<'_>,
    kind: String,
    x: Desc,
    y: Desc,
    residual: Option<Desc>,
    weight: Option<Desc>,
    bias: Option<Desc>,
    h: Option<Desc>,
    mean: Option<Desc>,
    rstd: Option<Desc>,
    eps: f64,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    let op = format!("ferrite.{kind}");
    run(py, &op.clone(), move || {
        let op = op.as_str();
        let k = norm_kind(op, &kind)?;
        let tgt = target(op, device, stream)?;
        let x = wrap(op, "x", &x, &tgt)?;
        let y = wrap(op, "y", &y, &tgt)?;
        let residual = wrap_opt(op, "residual", &residual, &tgt)?;
        let weight = wrap_opt(op, "weight", &weight, &tgt)?;
        let bias = wrap_opt(op, "bias", &bias, &tgt)?;
        let h = wrap_opt(op, "h", &h, &tgt)?;
        let mean = wrap_opt(op, "mean", &mean, &tgt)?;
        let rstd = wrap_opt(op, "rstd", &rstd, &tgt)?;
        let opts = NormOptions {
            variant,
            eps: eps as f32,
            stream: tgt.stream(),
        };
        fnorm::forward_into(
            k,
            &Fwd {
                x: &x.t,
                residual: opt_ref(&residual),
                weight: opt_ref(&weight),
                bias: opt_ref(&bias),
            },
            &FwdOut {
                y: &y.t,
                h: opt_ref(&h),
                mean: opt_ref(&mean),
                rstd: opt_ref(&rstd),
            },
            &opts,
        )?;
        for o in [Some(&y), h.as_ref(), mean.as_ref(), rstd.as_ref()]
            .into_iter()
            .flatten()
        {
            o.write_back()?;
        }
        Ok(())
    })
}

/// Norm backward into caller-provided outputs (ferrite's `norm::backward_into`): dx, and dweight
/// / dbias (reduced deterministically) when given. `x` is the normalised input (h when the
/// residual was fused); `mean` (LayerNorm only) and `rstd` are the forward's.
#[pyfunction]
#[pyo3(signature = (kind, dy, x, rstd, dx, weight=None, mean=None, dweight=None, dbias=None, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
fn norm_backward(
    py: Python<'_>,
    kind: String,
    dy: Desc,
    x: Desc,
    rstd: Desc,
    dx: Desc,
    weight: Option<Desc>,
    mean: Option<Desc>,
    dweight: Option<Desc>,
    dbias: Option<Desc>,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    let op = format!("ferrite.{kind}_backward");
    run(py, &op.clone(), move || {
        let op = op.as_str();
        let k = norm_kind(op, &kind)?;
        let tgt = target(op, device, stream)?;
        let dy = wrap(op, "dy", &dy, &tgt)?;
        let x = wrap(op, "x", &x, &tgt)?;
        let rstd = wrap(op, "rstd", &rstd, &tgt)?;
        let dx = wrap(op, "dx", &dx, &tgt)?;
        let weight = wrap_opt(op, "weight", &weight, &tgt)?;
        let mean = wrap_opt(op, "mean", &mean, &tgt)?;
        let dweight = wrap_opt(op, "dweight", &dweight, &tgt)?;
        let dbias = wrap_opt(op, "dbias", &dbias, &tgt)?;
        let opts = NormOptions {
            variant,
            stream: tgt.stream(),
            ..Default::default()
        };
        fnorm::backward_into(
            k,
            &Bwd {
                dy: &dy.t,
                x: &x.t,
                weight: opt_ref(&weight),
                mean: opt_ref(&mean),
                rstd: &rstd.t,
            },
            &BwdOut {
                dx: &dx.t,
                dweight: opt_ref(&dweight),
                dbias: opt_ref(&dbias),
            },
            &opts,
        )?;
        for o in [Some(&dx), dweight.as_ref(), dbias.as_ref()]
            .into_iter()
            .flatten()
        {
            o.write_back()?;
        }
        Ok(())
    })
}

/// (number of CUDA devices ferrite can use, None) or (0, the reason it cannot).
#[pyfunction]
fn cuda_status() -> (usize, Option<String>) {
    match catch_unwind(fcuda::availability) {
        Ok(Ok(n)) => (n, None),
        Ok(Err(e)) => (0, Some(e.to_string())),
        Err(_) => (0, Some("probing the CUDA driver panicked".into())),
    }
}

/// The variants of an op family (a name of `ferrite list`: matmul, linear, norm, softmax,
/// activation, cross_entropy, adamw, attention, decode) as (name, backend, dtypes, summary).
#[pyfunction]
fn variants(op: &str) -> PyResult<Vec<(String, String, Vec<String>, String)>> {
    use ferrite::ops;
    let vs = match op {
        "matmul" => fmatmul::variants(),
        "linear" => ops::linear::variants(),
        "norm" => fnorm::variants(),
        "softmax" => ops::softmax::variants(),
        "activation" => ops::activation::variants(),
        "cross_entropy" => ops::cross_entropy::variants(),
        "adamw" => ops::adamw::variants(),
        "attention" => ops::attention::variants(),
        "decode" => ops::decode::variants(),
        other => {
            return Err(PyValueError::new_err(format!(
                "ferrite.variants: argument `op`: expected one of matmul, linear, norm, softmax, \
                 activation, cross_entropy, adamw, attention, decode, got {other}"
            )))
        }
    };
    Ok(vs
        .into_iter()
        .map(|v| {
            (
                v.name.to_string(),
                format!("{:?}", v.backend).to_lowercase(),
                v.dtypes.iter().map(|d| d.name().to_string()).collect(),
                v.summary.to_string(),
            )
        })
        .collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(matmul, m)?)?;
    m.add_function(wrap_pyfunction!(train::gpt2_train_steps, m)?)?;
    m.add_function(wrap_pyfunction!(norm_forward, m)?)?;
    m.add_function(wrap_pyfunction!(norm_backward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::linear_forward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::linear_backward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::softmax_forward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::softmax_backward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::rotary, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::scaled_mm, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::quantize_fp8, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::w8a16, m)?)?;
    m.add_function(wrap_pyfunction!(fused::bias_act_dropout, m)?)?;
    m.add_function(wrap_pyfunction!(fused::bias_act_dropout_backward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::glu_forward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::glu_backward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::cross_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(fused::cross_entropy_scale_grad, m)?)?;
    m.add_function(wrap_pyfunction!(fused::adamw_step, m)?)?;
    m.add_function(wrap_pyfunction!(attn::attention_forward, m)?)?;
    m.add_function(wrap_pyfunction!(attn::attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(attn::paged_decode, m)?)?;
    m.add_function(wrap_pyfunction!(attn::paged_decode_plan_numel, m)?)?;
    m.add_function(wrap_pyfunction!(attn::paged_decode_plan, m)?)?;
    m.add_function(wrap_pyfunction!(attn::paged_decode_plan_errors, m)?)?;
    m.add_function(wrap_pyfunction!(attn::append_kv, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_forward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_backward, m)?)?;
    m.add_function(wrap_pyfunction!(moe::grouped_mm, m)?)?;
    m.add_function(wrap_pyfunction!(moe::grouped_mm_weight_grad, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(variants, m)?)?;
    Ok(())
}
