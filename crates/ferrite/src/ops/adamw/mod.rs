//! # adamw — one fused AdamW step over many tensors
//!
//! `torch.optim.AdamW` semantics (decoupled weight decay, bias correction, no amsgrad), fp32
//! arithmetic, in place:
//!
//! ```text
//! g = grad·grad_scale;  m = m + (1−β1)(g − m);  v = β2·v + (1−β2)·g²
//! p = p·(1 − lr·wd) − lr/(1−β1^t) · m / (√v/√(1−β2^t) + eps)
//! ```
//!
//! Per tensor: param f32 or bf16; grad the param's dtype or f32; exp_avg (m) and exp_avg_sq (v)
//! f32. bf16 params need an f32 master copy: the update runs on the master and the param becomes
//! the master rounded to nearest. Every tensor of one call has the same (param, grad) dtypes (as
//! torch's fused optimizer groups them); `grad_scale` is 1/loss-scale for mixed precision.
//!
//! Variants — CPU: `naive` (one thread) → `parallel` (chunks across cores, same arithmetic).
//! CUDA: `naive` (one launch per tensor, scalar loads) → `multi_tensor` (one launch for the whole
//! list: a device table of tensors and a block → (tensor, chunk) map built on the host, 4-wide
//! vector loads). The table upload costs a host→device copy and a stream synchronisation per
//! call; a training loop builds an [`AdamWPlan`] once and steps it asynchronously (also
//! under CUDA-graph capture). See kernels/adamw.cu.

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

pub use cuda::AdamWPlan;

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
pub const OP: &str = "adamw";
const PARAMS: &[DType] = &[DType::F32, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: PARAMS, min_arch: None, constraints: "any", summary: "one thread, element by element", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: PARAMS, min_arch: None, constraints: "any", summary: "chunks across cores (same arithmetic)", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: PARAMS, min_arch: Some(Arch::SM80), constraints: "any", summary: "one launch per tensor, scalar loads", rank: 1 },
        VariantInfo {
            name: "multi_tensor",
            backend: Backend::Cuda,
            dtypes: PARAMS,
            min_arch: Some(Arch::SM80),
            constraints: "any (vector loads where a tensor's arrays are aligned)",
            summary: "one launch for every tensor (device table + block→(tensor, chunk) map), 4-wide vector loads",
            rank: 2,
        },
    ]
}

/// One parameter tensor and its state. All contiguous, the same number of elements.
#[derive(Clone, Copy, Debug)]
pub struct AdamWTensor<'a> {
    /// The parameter, updated in place (f32, or bf16 with `master`).
    pub param: &'a Tensor,
    /// Its gradient (the param's dtype or f32), read only.
    pub grad: &'a Tensor,
    /// The first moment m (f32), updated in place.
    pub exp_avg: &'a Tensor,
    /// The second moment v (f32), updated in place.
    pub exp_avg_sq: &'a Tensor,
    /// f32 master weights: required for bf16 params, refused for f32 params.
    pub master: Option<&'a Tensor>,
}

/// The step's hyperparameters (torch's names and defaults, lr aside).
#[derive(Clone, Copy, Debug)]
pub struct AdamWHyper {
    /// Learning rate (≥ 0: warm-up schedules start at 0, and the moments still move).
    pub lr: f64,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f64,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f64,
    /// Added to √v̂ in the denominator (> 0).
    pub eps: f64,
    /// Decoupled weight decay: p shrinks by lr·weight_decay each step (≥ 0).
    pub weight_decay: f64,
    /// This step's number, from 1 (bias correction).
    pub step: u64,
    /// Multiplies the grads (1/loss-scale); 1 for none.
    pub grad_scale: f64,
}

impl Default for AdamWHyper {
    fn default() -> Self {
        AdamWHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            step: 1,
            grad_scale: 1.0,
        }
    }
}

/// The per-step constants the kernels take, computed in f64 and rounded once.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// β1, rounded to f32.
    pub beta1: f32,
    /// β2, rounded to f32.
    pub beta2: f32,
    /// 1 − β1 and 1 − β2 from f64 (1 − f32(0.999) is 1.3e-5 off, relatively, as torch avoids).
    pub one_minus_beta1: f32,
    /// 1 − β2 (see `one_minus_beta1`).
    pub one_minus_beta2: f32,
    /// eps, rounded to f32.
    pub eps: f32,
    /// 1 − lr·wd
    pub decay: f32,
    /// lr / (1 − β1^t)
    pub step_size: f32,
    /// 1 / √(1 − β2^t)
    pub inv_bc2_sqrt: f32,
    /// grad_scale, rounded to f32.
    pub grad_scale: f32,
}

impl AdamWHyper {
    /// Checks the ranges (an error names the first value out of range) and computes the
    /// kernels' constants for this step.
    pub fn validate(&self) -> Result<Hyper> {
        let pos = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::bad_arg(OP, name, "a finite number > 0", v))
            }
        };
        // lr = 0 is a step (the moments still move), as torch allows: warm-up schedules start there.
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(Error::bad_arg(OP, "lr", "a finite number ≥ 0", self.lr));
        }
        pos("eps", self.eps)?;
        pos("grad_scale", self.grad_scale)?;
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::bad_arg(OP, name, "a number in [0, 1)", b));
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::bad_arg(
                OP,
                "weight_decay",
                "a finite number ≥ 0",
                self.weight_decay,
            ));
        }
        if self.step == 0 || self.step > i32::MAX as u64 {
            return Err(Error::bad_arg(
                OP,
                "step",
                "a step number in 1..2³¹",
                self.step,
            ));
        }
        let t = self.step as i32;
        Ok(Hyper {
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            step_size: (self.lr / (1.0 - self.beta1.powi(t))) as f32,
            inv_bc2_sqrt: (1.0 / (1.0 - self.beta2.powi(t)).sqrt()) as f32,
            grad_scale: self.grad_scale as f32,
        })
    }
}

/// Options of one step. `Default`: best variant, the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct AdamWOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

/// What one call updates: the shared dtypes and device.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// The params' dtype.
    pub param: DType,
    /// The grads' dtype.
    pub grad: DType,
    /// The shared device.
    pub device: Device,
    /// Tensors in the list.
    pub tensors: usize,
    /// Elements over all of them.
    pub numel: usize,
}

fn validate(ts: &[AdamWTensor]) -> Result<Problem> {
    let Some(first) = ts.first() else {
        return Err(Error::bad_arg(
            OP,
            "tensors",
            "at least one tensor",
            "an empty list",
        ));
    };
    let (pd, gd, dev) = (
        first.param.dtype(),
        first.grad.dtype(),
        first.param.device(),
    );
    if !PARAMS.contains(&pd) || !(gd == pd || gd == DType::F32) {
        return Err(Error::bad_arg(
            OP,
            "tensors[0].param/grad",
            "params f32 or bf16, grads of the param's dtype or f32",
            format!(
                "param {}, grad {}",
                describe(first.param),
                describe(first.grad)
            ),
        ));
    }
    let mut numel = 0usize;
    for (i, t) in ts.iter().enumerate() {
        let n = t.param.numel();
        let arg = |what: &str| format!("tensors[{i}].{what}");
        let check = |what: &str, x: &Tensor, dtype: DType| -> Result<()> {
            if x.dtype() != dtype || x.numel() != n || !x.is_contiguous() || x.device() != dev {
                return Err(Error::bad_arg(
                    OP,
                    arg(what),
                    format!("a contiguous {dtype} tensor of {n} elements on {dev}"),
                    describe(x),
                ));
            }
            Ok(())
        };
        check("param", t.param, pd)?;
        check("grad", t.grad, gd)?;
        check("exp_avg", t.exp_avg, DType::F32)?;
        check("exp_avg_sq", t.exp_avg_sq, DType::F32)?;
        match (pd, t.master) {
            (DType::BF16, Some(m)) => check("master", m, DType::F32)?,
            (DType::BF16, None) => {
                return Err(Error::bad_arg(
                    OP,
                    arg("master"),
                    "an f32 master copy for a bf16 param",
                    "none",
                ))
            }
            (_, Some(m)) => {
                return Err(Error::bad_arg(
                    OP,
                    arg("master"),
                    "none for an f32 param (the param is its own master)",
                    describe(m),
                ))
            }
            _ => {}
        }
        // Every updated buffer distinct from every other buffer of the list.
        let written: Vec<(&str, &Tensor)> = [
            ("param", t.param),
            ("exp_avg", t.exp_avg),
            ("exp_avg_sq", t.exp_avg_sq),
        ]
        .into_iter()
        .chain(t.master.map(|m| ("master", m)))
        .collect();
        for (what, w) in &written {
            for (j, u) in ts.iter().enumerate() {
                let others = [u.param, u.grad, u.exp_avg, u.exp_avg_sq]
                    .into_iter()
                    .chain(u.master);
                let hits = others.filter(|o| w.shares_storage(o)).count();
                // A tensor shares storage with itself once.
                if hits > usize::from(i == j) {
                    return Err(Error::bad_arg(
                        OP,
                        arg(what),
                        "a buffer of its own (written in place)",
                        format!("storage shared with tensors[{j}]"),
                    ));
                }
            }
        }
        numel += n;
    }
    Ok(Problem {
        param: pd,
        grad: gd,
        device: dev,
        tensors: ts.len(),
        numel,
    })
}

fn select(p: &Problem, requested: Option<&str>) -> Result<&'static str> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        OP,
        &vs,
        requested,
        Backend::of(p.device),
        p.param,
        arch,
        |_| None,
    )?;
    Ok(v.name)
}

/// One AdamW step over `tensors`, in place.
pub fn adamw_step(tensors: &[AdamWTensor], hp: &AdamWHyper, opts: &AdamWOptions) -> Result<()> {
    let h = hp.validate()?;
    let p = validate(tensors)?;
    let v = select(&p, opts.variant.as_deref())?;
    match p.device {
        Device::Cpu => cpu::step(v, tensors, &h),
        Device::Cuda(_) => cuda::step(v, &p, tensors, &h, opts),
    }
}

/// The family as the harness sees it (check, bench, kernels).
pub struct AdamW;

impl OpFamily for AdamW {
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
