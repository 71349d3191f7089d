//! Correctness checks: each op family compares each variant's output against an f64 CPU reference
//! on fresh random inputs, with outputs poisoned first. This file holds the shared pieces.

use crate::core::device::Device;
use crate::core::dtype::DType;

/// Which numeric contract a result is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// True fp32 arithmetic.
    F32,
    /// fp32 inputs through tensor cores (10-bit mantissa products).
    Tf32,
    /// bf16 inputs and outputs, f32 accumulation.
    Bf16,
    /// f16 inputs and outputs, f32 accumulation.
    F16,
    /// Bit-exact results (copies, gathers, integer ops).
    Exact,
    /// FP8 inputs, f32 output, partial sums in fp32: the error against the f64 product of the
    /// dequantised inputs is the accumulation's alone. On the CPU and in `naive` that is fp32's
    /// (≈ 1e-7); on Hopper's tensor cores each 128-deep partial sum is first added up by the FP8
    /// MMA's own adder, which keeps fewer mantissa bits than fp32 (measured ≈ 1e-4 relative at
    /// k 4096–8192 on an H200, for `wgmma` and cuBLASLt alike): bounded at 3e-4.
    Fp8,
    /// FP8 inputs, f32 output, the whole k sum in the tensor core's accumulator (`wgmma_fast`,
    /// cuBLASLt's FAST_ACCUM): the error grows with k (measured 1.1e-3 at k 4096, 1.5e-3 at
    /// 8192 on an H200): bounded at 4e-3 for the checked k ≤ 8192.
    Fp8FastAccum,
}

impl Precision {
    /// The contract of an op computing in `dtype` (f32 means true fp32, never tf32).
    pub fn of(dtype: DType) -> Precision {
        match dtype {
            DType::BF16 => Precision::Bf16,
            DType::F16 => Precision::F16,
            _ => Precision::F32,
        }
    }

    /// Relative Frobenius error allowed. fp32 rounding grows like √k·2⁻²⁴ in a length-k dot
    /// product, so f32 gets a little room above 1e-6 for the long reductions of the checks.
    pub fn tolerance(self) -> f64 {
        match self {
            Precision::F32 => 5e-6,
            Precision::Tf32 => 1e-3,
            Precision::Bf16 | Precision::F16 => 1e-2,
            Precision::Exact => 0.0,
            Precision::Fp8 => 3e-4,
            Precision::Fp8FastAccum => 4e-3,
        }
    }

    /// The lowercase name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::Exact => "exact",
            Precision::Fp8 => "fp8",
            Precision::Fp8FastAccum => "fp8-fast",
        }
    }
}

/// ‖out − ref‖ / ‖ref‖ (or ‖out‖ when ref is all zero). Any NaN or Inf in `out` gives +Inf, so
/// an unwritten (poisoned) or overflowed element always fails.
pub fn rel_error(out: &[f64], reference: &[f64]) -> f64 {
    if out.len() != reference.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&o, &r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// ‖out − ref‖ / max(‖ref‖, `scale`): for outputs that cancel, where a correct result's rounding
/// error scales with the norm of the terms (`scale`) rather than with the result's own norm. NaN
/// or Inf in `out` gives +Inf, as in [`rel_error`].
pub fn rel_error_scaled(out: &[f64], reference: &[f64], scale: f64) -> f64 {
    let e = rel_error(out, reference);
    let den: f64 = reference.iter().map(|r| r * r).sum::<f64>().sqrt();
    if !e.is_finite() || den == 0.0 && scale == 0.0 {
        return e;
    }
    let abs = if den == 0.0 { e } else { e * den };
    abs / den.max(scale)
}

/// [`rel_error`] of an output stored in `dtype`: the reference's norm floored at the dtype's
/// smallest normal per element, so a tiny result that lands in the subnormal range (where
/// rounding is a fixed quantum, e.g. a 1×1×1 f16 product of small factors) is judged by that
/// quantum rather than failing on a correctly rounded value. NaN or Inf gives +Inf.
pub fn rel_error_in(out: &[f64], reference: &[f64], dtype: DType) -> f64 {
    let floor = dtype.min_normal().unwrap_or(0.0) * (reference.len() as f64).sqrt();
    rel_error_scaled(out, reference, floor)
}

/// What `ferrite check` runs.
#[derive(Clone, Debug)]
pub struct CheckConfig {
    /// Devices to run on.
    pub devices: Vec<Device>,
    /// Only these variants (all when empty).
    pub variants: Vec<String>,
    /// Only these dtypes (all the op supports when empty).
    pub dtypes: Vec<DType>,
    /// Seed for the inputs; fresh per run unless given.
    pub seed: u64,
    /// Smaller shape set (unit tests).
    pub quick: bool,
}

impl CheckConfig {
    /// Whether the variant (or peer) called `name` is selected.
    pub fn wants_variant(&self, name: &str) -> bool {
        self.variants.is_empty() || self.variants.iter().any(|v| v == name)
    }
    /// Whether `d` is selected.
    pub fn wants_dtype(&self, d: DType) -> bool {
        self.dtypes.is_empty() || self.dtypes.contains(&d)
    }
}

/// One line of the check table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckRecord {
    /// The family.
    pub op: String,
    /// The variant (or peer) checked.
    pub variant: String,
    /// The device it ran on.
    pub device: String,
    /// The input dtype.
    pub dtype: String,
    /// The contract the error is held to.
    pub precision: Precision,
    /// The case: shape and layout, in the family's words.
    pub shape: String,
    /// Relative error against the f64 reference (+Inf for NaN/Inf or an unwritten element).
    pub error: f64,
    /// The largest error that passes.
    pub tolerance: f64,
    /// `error <= tolerance`, and the case ran.
    pub pass: bool,
    /// Why a case failed to run, or what was special about it.
    pub note: String,
}

/// When set, every record is printed to stderr as it is made (`ferrite check --trace`).
static TRACE_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Starts printing each record to stderr as it is made, stamped with the seconds since this call.
pub fn trace_records() {
    let _ = TRACE_START.set(std::time::Instant::now());
}

/// Whether `--trace` is on: checks may then report the steps of a case as they finish (a hang
/// then names its kernel, not only its case).
pub fn tracing() -> bool {
    TRACE_START.get().is_some()
}

/// One step of a case under `--trace` (stderr, with the trace's clock).
pub fn trace_step(what: &str) {
    if let Some(t0) = TRACE_START.get() {
        eprintln!("[{:8.2} s]   … {what}", t0.elapsed().as_secs_f64());
    }
}

fn traced(r: CheckRecord) -> CheckRecord {
    if let Some(t0) = TRACE_START.get() {
        eprintln!(
            "[{:8.2} s] {} {} {} {} {}: {:.1e} (tol {:.1e}) {}{}",
            t0.elapsed().as_secs_f64(),
            r.op,
            r.variant,
            r.device,
            r.dtype,
            r.shape,
            r.error,
            r.tolerance,
            if r.pass { "ok" } else { "FAIL" },
            if r.note.is_empty() {
                String::new()
            } else {
                format!(" — {}", r.note)
            }
        );
    }
    r
}

impl CheckRecord {
    /// A compared result.
    #[allow(clippy::too_many_arguments)]
    pub fn compared(
        op: &str,
        variant: &str,
        device: Device,
        dtype: DType,
        precision: Precision,
        shape: String,
        error: f64,
        note: String,
    ) -> Self {
        let tolerance = precision.tolerance();
        traced(CheckRecord {
            op: op.into(),
            variant: variant.into(),
            device: device.to_string(),
            dtype: dtype.to_string(),
            precision,
            shape,
            error,
            tolerance,
            pass: error <= tolerance,
            note,
        })
    }

    /// A case that could not run (an error is a failure, never a skip).
    pub fn errored(
        op: &str,
        variant: &str,
        device: Device,
        dtype: DType,
        shape: String,
        err: String,
    ) -> Self {
        traced(CheckRecord {
            op: op.into(),
            variant: variant.into(),
            device: device.to_string(),
            dtype: dtype.to_string(),
            precision: Precision::of(dtype),
            shape,
            error: f64::INFINITY,
            tolerance: Precision::of(dtype).tolerance(),
            pass: false,
            note: err,
        })
    }
}

/// Every device this process can run on: the CPU, and the first GPU when CUDA is available.
pub fn devices_present() -> Vec<crate::core::device::Device> {
    let mut d = vec![Device::Cpu];
    match crate::core::cuda::availability() {
        Ok(_) => d.push(Device::Cuda(0)),
        Err(e) => eprintln!("GPU cases not run: {e}"),
    }
    d
}

/// The unit tests' use of a family's check: the quick case set on every device present with a
/// fresh seed; panics with the table (and the seed, to reproduce) unless every case passed and
/// at least `min_records` ran. Returns the records.
pub fn assert_quick_check_passes(
    run: impl Fn(&CheckConfig, &mut Vec<CheckRecord>) -> crate::core::error::Result<()>,
    min_records: usize,
) -> Vec<CheckRecord> {
    let cfg = CheckConfig {
        devices: devices_present(),
        variants: vec![],
        dtypes: vec![],
        seed: crate::core::rng::Rng::fresh_seed(),
        quick: true,
    };
    let mut recs = Vec::new();
    run(&cfg, &mut recs).expect("check run");
    assert!(
        recs.len() >= min_records,
        "only {} check records (expected ≥ {min_records})",
        recs.len()
    );
    assert!(
        recs.iter().all(|r| r.pass),
        "failures (seed {}):\n{}",
        cfg.seed,
        super::report::check_table(&recs)
    );
    recs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_and_inf_never_pass() {
        assert_eq!(rel_error(&[1.0, f64::NAN], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_error(&[1.0, f64::INFINITY], &[1.0, 2.0]), f64::INFINITY);
        assert!(rel_error(&[1.0, 2.0], &[1.0, 2.0]) == 0.0);
        assert!((rel_error(&[1.1], &[1.0]) - 0.1).abs() < 1e-12);
        assert_eq!(rel_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }

    #[test]
    fn scaled_error_divides_by_the_larger_of_result_and_terms() {
        // ‖ref‖ = 0.01, error 0.001: 0.1 relative to the result, 0.001 relative to terms of 1.
        let (out, want) = ([0.011, 0.0], [0.01, 0.0]);
        assert!((rel_error_scaled(&out, &want, 0.0) - 0.1).abs() < 1e-9);
        assert!((rel_error_scaled(&out, &want, 1.0) - 0.001).abs() < 1e-9);
        // Terms smaller than the result change nothing.
        assert!((rel_error_scaled(&out, &want, 1e-4) - 0.1).abs() < 1e-9);
        // An all-zero reference: the error is absolute, over the terms' norm.
        assert!((rel_error_scaled(&[0.002], &[0.0], 2.0) - 0.001).abs() < 1e-12);
        assert_eq!(rel_error_scaled(&[f64::NAN], &[1.0], 10.0), f64::INFINITY);
    }

    #[test]
    fn a_subnormal_output_is_judged_by_its_dtypes_quantum() {
        // -9.686e-7 rounded to f16's subnormal quantum (2⁻²⁴) is -9.537e-7 (16 quanta): 1.5e-2
        // relative to itself, within half a quantum of the reference.
        let (want, got) = (-9.685928e-7, -16.0 * 2f64.powi(-24));
        assert!(rel_error(&[got], &[want]) > 1e-2);
        assert!(rel_error_in(&[got], &[want], DType::F16) < 2f64.powi(-11));
        // Off by three quanta it still fails, and a normal-range value keeps its relative error.
        assert!(rel_error_in(&[got - 3.0 * 2f64.powi(-24)], &[want], DType::F16) > 2f64.powi(-11));
        assert!((rel_error_in(&[1.1], &[1.0], DType::F16) - 0.1).abs() < 1e-12);
        assert_eq!(
            rel_error_in(&[f64::NAN], &[want], DType::F16),
            f64::INFINITY
        );
        assert_eq!(DType::BF16.min_normal(), DType::F32.min_normal());
        assert_eq!(DType::I32.min_normal(), None);
    }
}
