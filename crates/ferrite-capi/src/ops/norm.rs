//! RMSNorm and LayerNorm: forward and backward.

use crate::boundary::call;
use crate::operand::{opt_ref, write_back_all, Call, Operand};
use crate::{FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::norm;
use ferrite::Result;

fn norm_options(c: &Call, eps: f32) -> norm::NormOptions {
    norm::NormOptions {
        variant: None,
        eps,
        stream: c.stream(),
    }
}

#[allow(clippy::too_many_arguments)]
fn norm_forward(
    c: &Call,
    kind: norm::NormKind,
    x: Operand,
    residual: Option<Operand>,
    weight: Option<Operand>,
    bias: Option<Operand>,
    y: Operand,
    h: Option<Operand>,
    mean: Option<Operand>,
    rstd: Option<Operand>,
    eps: f32,
) -> Result<()> {
    let opts = norm_options(c, eps);
    norm::forward_into(
        kind,
        &norm::Fwd {
            x: &x.t,
            residual: opt_ref(&residual),
            weight: opt_ref(&weight),
            bias: opt_ref(&bias),
        },
        &norm::FwdOut {
            y: &y.t,
            h: opt_ref(&h),
            mean: opt_ref(&mean),
            rstd: opt_ref(&rstd),
        },
        &opts,
    )?;
    write_back_all(&[Some(&y), h.as_ref(), mean.as_ref(), rstd.as_ref()])
}

/// RMSNorm over the last dim: y = h·rstd·weight with h = x (+ residual, written to `h` when
/// given), rstd = 1/√(mean(h²) + eps) (f32 `[rows]`, saved for the backward when `rstd` is given).
/// x, residual, y, h: one contiguous shape `[..., cols]` and dtype (f32, f16, bf16); weight
/// `[cols]`. `residual`, `weight`, `h`, `rstd` may be NULL (`h` only without a residual).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_rms_norm_forward(
    device: FerriteDevice,
    x: *const FerriteTensor,
    residual: *const FerriteTensor,
    weight: *const FerriteTensor,
    y: *const FerriteTensor,
    h: *const FerriteTensor,
    rstd: *const FerriteTensor,
    eps: f32,
) -> FerriteStatus {
    const OP: &str = "ferrite_rms_norm_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (x, residual, weight, y, h, rstd) = unsafe {
            (
                c.tensor("x", x)?,
                c.opt_tensor("residual", residual)?,
                c.opt_tensor("weight", weight)?,
                c.tensor("y", y)?,
                c.opt_tensor("h", h)?,
                c.opt_tensor("rstd", rstd)?,
            )
        };
        norm_forward(
            &c,
            norm::NormKind::Rms,
            x,
            residual,
            weight,
            None,
            y,
            h,
            None,
            rstd,
            eps,
        )
    })
}

/// LayerNorm over the last dim: y = (h − mean)·rstd·weight + bias with h = x (+ residual), mean
/// and rstd = 1/√(var + eps) f32 `[rows]` (saved for the backward when given). Shapes as in
/// `ferrite_rms_norm_forward`; `residual`, `weight`, `bias`, `h`, `mean`, `rstd` may be NULL.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_layer_norm_forward(
    device: FerriteDevice,
    x: *const FerriteTensor,
    residual: *const FerriteTensor,
    weight: *const FerriteTensor,
    bias: *const FerriteTensor,
    y: *const FerriteTensor,
    h: *const FerriteTensor,
    mean: *const FerriteTensor,
    rstd: *const FerriteTensor,
    eps: f32,
) -> FerriteStatus {
    const OP: &str = "ferrite_layer_norm_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (x, residual, weight, bias, y, h, mean, rstd) = unsafe {
            (
                c.tensor("x", x)?,
                c.opt_tensor("residual", residual)?,
                c.opt_tensor("weight", weight)?,
                c.opt_tensor("bias", bias)?,
                c.tensor("y", y)?,
                c.opt_tensor("h", h)?,
                c.opt_tensor("mean", mean)?,
                c.opt_tensor("rstd", rstd)?,
            )
        };
        norm_forward(
            &c,
            norm::NormKind::Layer,
            x,
            residual,
            weight,
            bias,
            y,
            h,
            mean,
            rstd,
            eps,
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn norm_backward(
    c: &Call,
    kind: norm::NormKind,
    dy: &Operand,
    x: &Operand,
    weight: &Option<Operand>,
    mean: &Option<Operand>,
    rstd: &Operand,
    dx: &Operand,
    dweight: &Option<Operand>,
    dbias: &Option<Operand>,
) -> Result<()> {
    norm::backward_into(
        kind,
        &norm::Bwd {
            dy: &dy.t,
            x: &x.t,
            weight: opt_ref(weight),
            mean: opt_ref(mean),
            rstd: &rstd.t,
        },
        &norm::BwdOut {
            dx: &dx.t,
            dweight: opt_ref(dweight),
            dbias: opt_ref(dbias),
        },
        &norm_options(c, 1e-5),
    )?;
    write_back_all(&[Some(dx), dweight.as_ref(), dbias.as_ref()])
}

/// dx (and dweight, reduced deterministically, when given) of `ferrite_rms_norm_forward` from dy,
/// the normalised input x (h when the residual was fused) and the forward's rstd.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_rms_norm_backward(
    device: FerriteDevice,
    dy: *const FerriteTensor,
    x: *const FerriteTensor,
    weight: *const FerriteTensor,
    rstd: *const FerriteTensor,
    dx: *const FerriteTensor,
    dweight: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_rms_norm_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (dy, x, weight, rstd, dx, dweight) = unsafe {
            (
                c.tensor("dy", dy)?,
                c.tensor("x", x)?,
                c.opt_tensor("weight", weight)?,
                c.tensor("rstd", rstd)?,
                c.tensor("dx", dx)?,
                c.opt_tensor("dweight", dweight)?,
            )
        };
        norm_backward(
            &c,
            norm::NormKind::Rms,
            &dy,
            &x,
            &weight,
            &None,
            &rstd,
            &dx,
            &dweight,
            &None,
        )
    })
}

/// dx (and dweight, dbias, reduced deterministically, when given) of `ferrite_layer_norm_forward`
/// from dy, the normalised input x (h when the residual was fused) and the forward's mean, rstd.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_layer_norm_backward(
    device: FerriteDevice,
    dy: *const FerriteTensor,
    x: *const FerriteTensor,
    weight: *const FerriteTensor,
    mean: *const FerriteTensor,
    rstd: *const FerriteTensor,
    dx: *const FerriteTensor,
    dweight: *const FerriteTensor,
    dbias: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_layer_norm_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (dy, x, weight, mean, rstd, dx, dweight, dbias) = unsafe {
            (
                c.tensor("dy", dy)?,
                c.tensor("x", x)?,
                c.opt_tensor("weight", weight)?,
                c.tensor("mean", mean)?,
                c.tensor("rstd", rstd)?,
                c.tensor("dx", dx)?,
                c.opt_tensor("dweight", dweight)?,
                c.opt_tensor("dbias", dbias)?,
            )
        };
        norm_backward(
            &c,
            norm::NormKind::Layer,
            &dy,
            &x,
            &weight,
            &Some(mean),
            &rstd,
            &dx,
            &dweight,
            &dbias,
        )
    })
}
