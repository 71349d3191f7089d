//! Fused softmax cross-entropy and its gradient scaling.

use super::read_opts;
use crate::boundary::call;
use crate::operand::{bad, opt_ref, write_back_all, Call};
use crate::{
    FerriteDevice, FerriteReduction, FerriteStatus, FerriteTensor, FERRITE_REDUCTION_MEAN,
};
use ferrite::ops::cross_entropy as ce;

/// Options of `ferrite_cross_entropy` (`ferrite_cross_entropy_options_default()` gives torch's
/// defaults).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteCrossEntropyOptions {
    /// Rows whose target equals this contribute no loss and get a zero gradient (-100).
    pub ignore_index: i64,
    /// ε in [0, 1): the target distribution is (1−ε)·one-hot + ε/V (0).
    pub label_smoothing: f32,
    /// A `FERRITE_REDUCTION_*` code (mean).
    pub reduction: FerriteReduction,
    /// The incoming gradient of the scalar loss: scales the gradient (1).
    pub dloss: f32,
    /// CUDA: read the bad-target flag back after the launch (a small copy and a synchronisation
    /// of the stream) and fail on a target outside [0, V); off: asynchronous, and a bad row's loss
    /// and gradient are NaN (true).
    pub check_targets: bool,
    /// Write the gradient over the logits (`grad` must then be NULL) (false).
    pub grad_in_place: bool,
}

/// torch's defaults: ignore_index −100, no smoothing, mean, dloss 1, targets checked, gradient
/// into `grad`.
#[no_mangle]
pub extern "C" fn ferrite_cross_entropy_options_default() -> FerriteCrossEntropyOptions {
    FerriteCrossEntropyOptions {
        ignore_index: -100,
        label_smoothing: 0.0,
        reduction: FERRITE_REDUCTION_MEAN,
        dloss: 1.0,
        check_targets: true,
        grad_in_place: false,
    }
}

/// Fused softmax cross-entropy, forward and backward in one call: logits `[N, V]` (f32, f16,
/// bf16), targets `[N]` (int64 or int32 class indices), per-row losses `loss_rows` f32 `[N]`,
/// the reduced loss `loss` f32 `[1]` (optional) and dlogits into `grad` (like logits, optional)
/// or over the logits (`grad_in_place`). `options` NULL: the defaults.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_cross_entropy(
    device: FerriteDevice,
    logits: *const FerriteTensor,
    targets: *const FerriteTensor,
    loss_rows: *const FerriteTensor,
    loss: *const FerriteTensor,
    grad: *const FerriteTensor,
    options: *const FerriteCrossEntropyOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_cross_entropy";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let o = unsafe { read_opts(OP, "options", options)? }
            .unwrap_or_else(|| ferrite_cross_entropy_options_default());
        let reduction = match o.reduction.0 {
            0 => ce::Reduction::Mean,
            1 => ce::Reduction::Sum,
            2 => ce::Reduction::None,
            other => {
                return Err(bad(
                    OP,
                    "options.reduction",
                    "a FERRITE_REDUCTION_* code (0 mean, 1 sum, 2 none)",
                    other,
                ))
            }
        };
        // SAFETY: this function's contract.
        let (logits, targets, loss_rows, loss, grad) = unsafe {
            (
                c.tensor("logits", logits)?,
                c.tensor("targets", targets)?,
                c.tensor("loss_rows", loss_rows)?,
                c.opt_tensor("loss", loss)?,
                c.opt_tensor("grad", grad)?,
            )
        };
        let g = match (&grad, o.grad_in_place) {
            (Some(_), true) => {
                return Err(bad(
                    OP,
                    "grad",
                    "NULL when options.grad_in_place is set",
                    "a tensor",
                ))
            }
            (Some(g), false) => ce::GradOut::Into(&g.t),
            (None, true) => ce::GradOut::InPlace,
            (None, false) => ce::GradOut::Skip,
        };
        let opts = ce::CrossEntropyOptions {
            variant: None,
            stream: c.stream(),
            ignore_index: o.ignore_index,
            label_smoothing: o.label_smoothing,
            reduction,
            dloss: o.dloss,
            check_targets: o.check_targets,
            cluster: None,
        };
        ce::cross_entropy_into(
            &logits.t,
            &targets.t,
            &loss_rows.t,
            opt_ref(&loss),
            g,
            &opts,
        )?;
        let in_place = o.grad_in_place.then_some(&logits);
        write_back_all(&[Some(&loss_rows), loss.as_ref(), grad.as_ref(), in_place])
    })
}

/// grad *= dloss in place: the backward step of a cross-entropy computed with dloss = 1 before
/// the incoming gradient was known. grad contiguous `[N, V]` or `[V]`; dloss one element (mean,
/// sum) or `[N]` (none), in grad's dtype. On CUDA dloss is read by the kernel (no host read).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_cross_entropy_scale_grad(
    device: FerriteDevice,
    grad: *const FerriteTensor,
    dloss: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_cross_entropy_scale_grad";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (grad, dloss) = unsafe { (c.tensor("grad", grad)?, c.tensor("dloss", dloss)?) };
        ce::scale_grad_in_place(&grad.t, &dloss.t, c.stream())?;
        grad.write_back()
    })
}
