//! linear: forward and backward.

use super::{activation_of, precision};
use crate::boundary::call;
use crate::operand::{opt_ref, write_back_all, Call};
use crate::{FerriteActivation, FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::linear;
use ferrite::Result;

fn linear_options(
    c: &Call,
    act: FerriteActivation,
    allow_tf32: bool,
) -> Result<linear::LinearOptions> {
    Ok(linear::LinearOptions {
        activation: activation_of(c.op(), "activation", act)?,
        precision: precision(allow_tf32),
        stream: c.stream(),
        ..Default::default()
    })
}

/// y = act(x·weightᵀ + bias) (+ residual), and the pre-activation z = x·weightᵀ + bias when `z` is
/// given (ferrite's `linear::forward_into`: bias, activation and residual in the GEMM's
/// epilogue). x `[..., in]`, weight `[out, in]`, bias `[out]` (optional), residual, y, z
/// `[..., out]`; one dtype (f32, f16, bf16). `bias`, `residual`, `z` may be NULL.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_linear_forward(
    device: FerriteDevice,
    x: *const FerriteTensor,
    weight: *const FerriteTensor,
    bias: *const FerriteTensor,
    residual: *const FerriteTensor,
    y: *const FerriteTensor,
    z: *const FerriteTensor,
    activation: FerriteActivation,
    allow_tf32: bool,
) -> FerriteStatus {
    const OP: &str = "ferrite_linear_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        let opts = linear_options(&c, activation, allow_tf32)?;
        // SAFETY: this function's contract.
        let (x, w, bias, residual, y, z) = unsafe {
            (
                c.tensor("x", x)?,
                c.tensor("weight", weight)?,
                c.opt_tensor("bias", bias)?,
                c.opt_tensor("residual", residual)?,
                c.tensor("y", y)?,
                c.opt_tensor("z", z)?,
            )
        };
        linear::forward_into(
            &linear::Fwd {
                x: &x.t,
                w: &w.t,
                bias: opt_ref(&bias),
                residual: opt_ref(&residual),
            },
            &linear::FwdOut {
                y: &y.t,
                z: opt_ref(&z),
            },
            &opts,
        )?;
        write_back_all(&[Some(&y), z.as_ref()])
    })
}

/// dx, dweight, dbias of `ferrite_linear_forward` from dy (ferrite's `linear::backward_into`:
/// the activation's backward fused with the deterministic bias reduction, then two GEMMs). `z`
/// (the forward's pre-activation) is required unless the activation is none; any of dx, dweight,
/// dbias may be NULL.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_linear_backward(
    device: FerriteDevice,
    dy: *const FerriteTensor,
    x: *const FerriteTensor,
    weight: *const FerriteTensor,
    z: *const FerriteTensor,
    dx: *const FerriteTensor,
    dweight: *const FerriteTensor,
    dbias: *const FerriteTensor,
    activation: FerriteActivation,
    allow_tf32: bool,
) -> FerriteStatus {
    const OP: &str = "ferrite_linear_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        let opts = linear_options(&c, activation, allow_tf32)?;
        // SAFETY: this function's contract.
        let (dy, x, w, z, dx, dw, db) = unsafe {
            (
                c.tensor("dy", dy)?,
                c.tensor("x", x)?,
                c.tensor("weight", weight)?,
                c.opt_tensor("z", z)?,
                c.opt_tensor("dx", dx)?,
                c.opt_tensor("dweight", dweight)?,
                c.opt_tensor("dbias", dbias)?,
            )
        };
        linear::backward_into(
            &linear::Bwd {
                dy: &dy.t,
                x: &x.t,
                w: &w.t,
                z: opt_ref(&z),
                x_pre: None,
            },
            &linear::BwdOut {
                dx: opt_ref(&dx),
                dw: opt_ref(&dw),
                db: opt_ref(&db),
                db_pre: None,
            },
            &opts,
        )?;
        write_back_all(&[dx.as_ref(), dw.as_ref(), db.as_ref()])
    })
}
