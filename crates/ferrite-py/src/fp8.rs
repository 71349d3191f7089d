//! The FP8 scaled GEMM (`ops::scaled_mm`) and the int8-weight matmul (`ops::w8a16`): descriptors
//! in, D allocated by the Python layer.

use crate::{opt_ref, run, target, wrap, wrap_opt, Desc};
use ferrite::ops::scaled_mm::{self as fsm, ScaledMmOptions};
use pyo3::prelude::*;

/// D = (scale_a ⊙ a)·(scale_b ⊙ b)ᵀ (+ bias): a `[m, k]`, b `[n, k]` in float8 (k contiguous),
/// f32 scales of 1 or m / n elements, D `[m, n]`.
#[pyfunction]
#[pyo3(signature = (a, b, scale_a, scale_b, bias, out, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn scaled_mm(
    py: Python<'_>,
    a: Desc,
    b: Desc,
    scale_a: Desc,
    scale_b: Desc,
    bias: Option<Desc>,
    out: Desc,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.scaled_mm";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let a = wrap(OP, "a", &a, &tgt)?;
        let b = wrap(OP, "b", &b, &tgt)?;
        let sa = wrap(OP, "scale_a", &scale_a, &tgt)?;
        let sb = wrap(OP, "scale_b", &scale_b, &tgt)?;
        let bias = wrap_opt(OP, "bias", &bias, &tgt)?;
        let out = wrap(OP, "out", &out, &tgt)?;
        let opts = ScaledMmOptions {
            variant,
            stream: tgt.stream(),
        };
        fsm::scaled_mm_into(&a.t, &b.t, &sa.t, &sb.t, opt_ref(&bias), &out.t, &opts)?;
        out.write_back()
    })
}

/// q = fp8(x · s), amax = max |x|, inv_scale = 1 / s: x `[rows, cols]` f32/f16/bf16, q of the same
/// shape in float8, amax and inv_scale f32 of 1 or `rows` elements (per tensor / per row), `scale`
/// the same count or None (current scaling: s = FMAX / amax).
#[pyfunction]
#[pyo3(signature = (x, scale, q, amax, inv_scale, device=-1, stream=0))]
#[allow(clippy::too_many_arguments)]
pub fn quantize_fp8(
    py: Python<'_>,
    x: Desc,
    scale: Option<Desc>,
    q: Desc,
    amax: Desc,
    inv_scale: Desc,
    device: i64,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "ferrite.quantize_fp8";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let scale = wrap_opt(OP, "scale", &scale, &tgt)?;
        let q = wrap(OP, "q", &q, &tgt)?;
        let amax = wrap(OP, "amax", &amax, &tgt)?;
        let inv = wrap(OP, "inv_scale", &inv_scale, &tgt)?;
        let opts = fsm::quantize::QuantizeOptions {
            stream: tgt.stream(),
        };
        fsm::quantize::quantize_fp8_into(&x.t, opt_ref(&scale), &q.t, &amax.t, &inv.t, &opts)?;
        q.write_back()?;
        amax.write_back()?;
        inv.write_back()
    })
}

/// D = a·(scale ⊙ w)ᵀ (+ bias), `ops::w8a16`: a `[m, k]` bf16/f16, w `[n, k]` int8 (k
/// contiguous), scale `[n]` f32, D `[m, n]` in a's dtype.
#[pyfunction]
#[pyo3(signature = (a, w, scale, bias, out, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn w8a16(
    py: Python<'_>,
    a: Desc,
    w: Desc,
    scale: Desc,
    bias: Option<Desc>,
    out: Desc,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    use ferrite::ops::w8a16::{w8a16_into, W8a16Options};
    const OP: &str = "ferrite.w8a16";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let a = wrap(OP, "a", &a, &tgt)?;
        let w = wrap(OP, "w", &w, &tgt)?;
        let s = wrap(OP, "scale", &scale, &tgt)?;
        let bias = wrap_opt(OP, "bias", &bias, &tgt)?;
        let out = wrap(OP, "out", &out, &tgt)?;
        let opts = W8a16Options {
            variant,
            stream: tgt.stream(),
        };
        w8a16_into(&a.t, &w.t, &s.t, opt_ref(&bias), &out.t, &opts)?;
        out.write_back()
    })
}
