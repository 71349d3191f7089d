//! softmax: forward and backward.

use crate::boundary::call;
use crate::operand::Call;
use crate::{FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::softmax;

/// y = softmax(scale·x) over the last dim (x, y: one contiguous shape and dtype: f32, f16, bf16).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_softmax_forward(
    device: FerriteDevice,
    x: *const FerriteTensor,
    y: *const FerriteTensor,
    scale: f32,
) -> FerriteStatus {
    const OP: &str = "ferrite_softmax_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (x, y) = unsafe { (c.tensor("x", x)?, c.tensor("y", y)?) };
        let opts = softmax::SoftmaxOptions {
            variant: None,
            scale,
            stream: c.stream(),
        };
        softmax::softmax_into(&x.t, &y.t, &opts)?;
        y.write_back()
    })
}

/// dx = scale · y ⊙ (dy − Σ dy⊙y) from the forward's output y.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_softmax_backward(
    device: FerriteDevice,
    dy: *const FerriteTensor,
    y: *const FerriteTensor,
    dx: *const FerriteTensor,
    scale: f32,
) -> FerriteStatus {
    const OP: &str = "ferrite_softmax_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (dy, y, dx) = unsafe { (c.tensor("dy", dy)?, c.tensor("y", y)?, c.tensor("dx", dx)?) };
        let opts = softmax::SoftmaxOptions {
            variant: None,
            scale,
            stream: c.stream(),
        };
        softmax::softmax_backward_into(&dy.t, &y.t, &dx.t, &opts)?;
        dx.write_back()
    })
}
