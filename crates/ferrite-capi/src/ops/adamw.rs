//! The fused AdamW step.

use super::{read_opts, size};
use crate::boundary::call;
use crate::operand::{bad, opt_ref, write_back_all, Call};
use crate::{FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::adamw;

/// One parameter tensor of an AdamW step and its state (all contiguous, the same element count).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteAdamWTensor {
    /// f32 or bf16, updated in place.
    pub param: *const FerriteTensor,
    /// The param's dtype or f32.
    pub grad: *const FerriteTensor,
    /// f32 first moment, updated in place.
    pub exp_avg: *const FerriteTensor,
    /// f32 second moment, updated in place.
    pub exp_avg_sq: *const FerriteTensor,
    /// f32 master weights: required for a bf16 param, NULL for an f32 one.
    pub master: *const FerriteTensor,
}

/// AdamW's hyperparameters (torch's names; `ferrite_adamw_hyper_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteAdamWHyper {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// (0.9).
    pub beta1: f64,
    /// (0.999).
    pub beta2: f64,
    /// (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (1e-2).
    pub weight_decay: f64,
    /// This step's number, from 1 (bias correction) (1).
    pub step: i64,
    /// Multiplies the gradients (1 / loss scale) (1).
    pub grad_scale: f64,
}

/// torch.optim.AdamW's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2),
/// step 1, no gradient scaling.
#[no_mangle]
pub extern "C" fn ferrite_adamw_hyper_default() -> FerriteAdamWHyper {
    let d = adamw::AdamWHyper::default();
    FerriteAdamWHyper {
        lr: d.lr,
        beta1: d.beta1,
        beta2: d.beta2,
        eps: d.eps,
        weight_decay: d.weight_decay,
        step: d.step as i64,
        grad_scale: d.grad_scale,
    }
}

/// One fused AdamW step over `count` tensors (torch.optim.AdamW semantics, fp32 arithmetic), in
/// place: params, moments and master weights. One launch for the whole list on CUDA (after a
/// small table upload and a synchronisation of the stream).
///
/// # Safety
/// `tensors` points to `count` readable `FerriteAdamWTensor`s, and see the pointer contract at
/// the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_adamw_step(
    device: FerriteDevice,
    tensors: *const FerriteAdamWTensor,
    count: i64,
    hyper: *const FerriteAdamWHyper,
) -> FerriteStatus {
    const OP: &str = "ferrite_adamw_step";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let h = unsafe { read_opts(OP, "hyper", hyper)? }
            .ok_or_else(|| bad(OP, "hyper", "a FerriteAdamWHyper", "a null pointer"))?;
        let n = size(OP, "count", count)?;
        if n > 0 && (tensors.is_null() || !tensors.is_aligned()) {
            return Err(bad(
                OP,
                "tensors",
                format!("a non-null, aligned array of {n} FerriteAdamWTensor"),
                format!("{tensors:p}"),
            ));
        }
        if n.checked_mul(std::mem::size_of::<FerriteAdamWTensor>())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(bad(
                OP,
                "count",
                "a count whose array fits in memory",
                count,
            ));
        }
        let list: &[FerriteAdamWTensor] = if n == 0 {
            &[]
        } else {
            // SAFETY: non-null and aligned (checked above), `n` readable entries (contract),
            // their byte size within isize::MAX (checked above).
            unsafe { std::slice::from_raw_parts(tensors, n) }
        };
        let mut wrapped = Vec::with_capacity(n);
        for (i, t) in list.iter().enumerate() {
            let arg = |s: &str| format!("tensors[{i}].{s}");
            // SAFETY: this function's contract.
            wrapped.push(unsafe {
                (
                    c.tensor(&arg("param"), t.param)?,
                    c.tensor(&arg("grad"), t.grad)?,
                    c.tensor(&arg("exp_avg"), t.exp_avg)?,
                    c.tensor(&arg("exp_avg_sq"), t.exp_avg_sq)?,
                    c.opt_tensor(&arg("master"), t.master)?,
                )
            });
        }
        let ts: Vec<adamw::AdamWTensor> = wrapped
            .iter()
            .map(|(p, g, m, v, master)| adamw::AdamWTensor {
                param: &p.t,
                grad: &g.t,
                exp_avg: &m.t,
                exp_avg_sq: &v.t,
                master: opt_ref(master),
            })
            .collect();
        let hp = adamw::AdamWHyper {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            step: u64::try_from(h.step).map_err(|_| bad(OP, "hyper.step", "a step ≥ 1", h.step))?,
            grad_scale: h.grad_scale,
        };
        let opts = adamw::AdamWOptions {
            variant: None,
            stream: c.stream(),
        };
        adamw::adamw_step(&ts, &hp, &opts)?;
        for (p, _, m, v, master) in &wrapped {
            write_back_all(&[Some(p), Some(m), Some(v), master.as_ref()])?;
        }
        Ok(())
    })
}
