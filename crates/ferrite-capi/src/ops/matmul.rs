//! matmul and grouped_mm.

use super::precision;
use crate::boundary::call;
use crate::operand::Call;
use crate::{FerriteDevice, FerriteStatus, FerriteTensor};
use ferrite::ops::{matmul, moe};

/// out = alpha·a·b + beta·out (ferrite's `matmul_into`).
///
/// a `[m, k]` or `[batch, m, k]`, b `[k, n]` or `[batch, k, n]` (each row-major or a transposed
/// view: stride 1 in one of its last two dims; a 2-D operand broadcasts over the batch); out
/// `[m, n]` / `[batch, m, n]` with stride 1 in its last dim. One dtype: f32, f16 or bf16 on CUDA,
/// f32 on the CPU. `allow_tf32`: f32 inputs may run on tensor cores as tf32 (CUDA).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_matmul(
    device: FerriteDevice,
    a: *const FerriteTensor,
    b: *const FerriteTensor,
    out: *const FerriteTensor,
    alpha: f32,
    beta: f32,
    allow_tf32: bool,
) -> FerriteStatus {
    const OP: &str = "ferrite_matmul";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (a, b, out) = unsafe { (c.tensor("a", a)?, c.tensor("b", b)?, c.tensor("out", out)?) };
        let opts = matmul::MatmulOptions {
            alpha,
            beta,
            precision: precision(allow_tf32),
            stream: c.stream(),
            ..Default::default()
        };
        matmul::matmul_into(&a.t, &b.t, &out.t, &opts)?;
        out.write_back()
    })
}

/// out[rows of g] = a[rows of g]·b[g] for the groups g of cumulative row ends `offs`
/// (`torch._grouped_mm` for 2-D a `[M, K]`, 3-D b `[G, K, N]`, int32 `offs` `[G]`, out `[M, N]`).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_grouped_mm(
    device: FerriteDevice,
    a: *const FerriteTensor,
    b: *const FerriteTensor,
    offs: *const FerriteTensor,
    out: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_grouped_mm";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (a, b, offs, out) = unsafe {
            (
                c.tensor("a", a)?,
                c.tensor("b", b)?,
                c.tensor("offs", offs)?,
                c.tensor("out", out)?,
            )
        };
        let opts = moe::MoeOptions {
            stream: c.stream(),
            ..Default::default()
        };
        moe::grouped_mm(&a.t, &b.t, &offs.t, &out.t, &opts)?;
        out.write_back()
    })
}
