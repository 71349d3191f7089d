//! The FP8 scaled GEMM (`ops::scaled_mm`): descriptors in, D allocated by the Python layer.

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
