//! The op entry points. Each one: the device selector and the descriptors checked and wrapped
//! (operand.rs), ferrite's `*_into` function called with the caller's buffers, CPU outputs held as
//! copies written back, and the outcome turned into a status (boundary.rs).
//!
//! Every `# Safety` section below means the same thing: each `FerriteTensor` (and options)
//! pointer is NULL or points to a descriptor that meets the pointer contract stated at the top of
//! `ferrite.h` (readable descriptors; data valid for the view over the whole call).

use crate::boundary::call;
use crate::operand::{bad, opt_ref, write_back_all, Call, Operand};
use crate::{
    FerriteActivation, FerriteAttentionLayout, FerriteDevice, FerriteMoeScore, FerriteReduction,
    FerriteStatus, FerriteTensor, FERRITE_ATTENTION_LAYOUT_BSHD, FERRITE_MOE_SCORE_SOFTMAX,
    FERRITE_REDUCTION_MEAN,
};
use ferrite::core::harness::Precision;
use ferrite::ops::{
    activation, adamw, attention, cross_entropy as ce, decode, linear, matmul, moe, norm, softmax,
};
use ferrite::{Error, Result, Tensor};

/// `v` as a size, refusing negative values.
fn size(op: &str, arg: &str, v: i64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(op, arg, "a value ≥ 0", v))
}

/// The options at `p` (None for NULL), checked aligned.
///
/// # Safety
/// A non-null, aligned `p` points to a readable `T`.
unsafe fn read_opts<T: Copy>(op: &str, arg: &str, p: *const T) -> Result<Option<T>> {
    if p.is_null() {
        return Ok(None);
    }
    if !p.is_aligned() {
        return Err(bad(op, arg, "an aligned pointer", format!("{p:p}")));
    }
    // SAFETY: non-null and aligned (checked above), readable by the caller's contract.
    Ok(Some(unsafe { p.read() }))
}

fn precision(allow_tf32: bool) -> Precision {
    if allow_tf32 {
        Precision::Tf32
    } else {
        Precision::F32
    }
}

const ACTIVATION_CODES: &str =
    "a FERRITE_ACTIVATION_* code (0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf, 4 silu)";

fn activation_of(op: &str, arg: &str, a: FerriteActivation) -> Result<activation::Activation> {
    use activation::Activation as A;
    Ok(match a.0 {
        0 => A::None,
        1 => A::Relu,
        2 => A::GeluTanh,
        3 => A::GeluErf,
        4 => A::Silu,
        other => return Err(bad(op, arg, ACTIVATION_CODES, other)),
    })
}

// ---------------------------------------------------------------------------------------------
// matmul

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

// ---------------------------------------------------------------------------------------------
// linear

fn linear_options(
    c: &Call,
    act: FerriteActivation,
    allow_tf32: bool,
) -> Result<linear::LinearOptions> {
    Ok(linear::LinearOptions {
        activation: activation_of(c.op(), "activation", act)?.into(),
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

// ---------------------------------------------------------------------------------------------
// norms

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

// ---------------------------------------------------------------------------------------------
// softmax

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

// ---------------------------------------------------------------------------------------------
// cross-entropy

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

// ---------------------------------------------------------------------------------------------
// attention

/// Options of the attention calls (`ferrite_attention_options_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteAttentionOptions {
    /// A `FERRITE_ATTENTION_LAYOUT_*` code (bshd; ignored for a varlen batch: `[total, H, D]`).
    pub layout: FerriteAttentionLayout,
    /// Each query sees keys up to its own position (bottom-right aligned) (false).
    pub causal: bool,
    /// Backward: the same bits on every run (slower on CUDA) (false).
    pub deterministic: bool,
    /// Score scale; 0: 1/√head_dim (0).
    pub scale: f32,
    /// Soft-cap c: scores become c·tanh(s/c); 0: off (0).
    pub softcap: f32,
    /// Keys visible to the left of a query's position; −1: unbounded (−1).
    pub window_left: i64,
    /// Keys visible to its right; −1: unbounded (causal makes it 0) (−1).
    pub window_right: i64,
}

/// A variable-length batch: q packed `[total_q, Hq, D]`, k and v `[total_k, Hkv, D]`, with int32
/// cumulative sequence lengths `[B + 1]` and the longest sequences.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteVarlen {
    /// int32 `[B + 1]`: query sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b + 1].
    pub cu_seqlens_q: *const FerriteTensor,
    /// int32 `[B + 1]`, the keys'.
    pub cu_seqlens_k: *const FerriteTensor,
    /// The longest query sequence.
    pub max_seqlen_q: i64,
    /// The longest key sequence.
    pub max_seqlen_k: i64,
}

/// bshd, not causal, deterministic off, scale 1/√D, no soft-cap, no window.
#[no_mangle]
pub extern "C" fn ferrite_attention_options_default() -> FerriteAttentionOptions {
    FerriteAttentionOptions {
        layout: FERRITE_ATTENTION_LAYOUT_BSHD,
        causal: false,
        deterministic: false,
        scale: 0.0,
        softcap: 0.0,
        window_left: -1,
        window_right: -1,
    }
}

/// The wrapped varlen tensors and sizes of a call.
struct VarlenOps {
    q: Operand,
    k: Operand,
    max_q: usize,
    max_k: usize,
}

impl VarlenOps {
    fn get(&self) -> attention::Varlen<'_> {
        attention::Varlen {
            cu_seqlens_q: &self.q.t,
            cu_seqlens_k: &self.k.t,
            max_seqlen_q: self.max_q,
            max_seqlen_k: self.max_k,
        }
    }
}

/// Reads the options and the varlen description of an attention call.
///
/// # Safety
/// The pointer contract (lib.rs) for `options`, `varlen` and the descriptors `varlen` points to.
unsafe fn attention_args(
    c: &mut Call,
    options: *const FerriteAttentionOptions,
    varlen: *const FerriteVarlen,
) -> Result<(attention::AttentionOptions, Option<VarlenOps>)> {
    let op = c.op();
    // SAFETY: forwarded to this function's contract.
    let o = unsafe { read_opts(op, "options", options)? }
        .unwrap_or_else(|| ferrite_attention_options_default());
    let layout = match o.layout.0 {
        0 => attention::Layout::Bshd,
        1 => attention::Layout::Bhsd,
        other => {
            return Err(bad(
                op,
                "options.layout",
                "a FERRITE_ATTENTION_LAYOUT_* code (0 bshd, 1 bhsd)",
                other,
            ))
        }
    };
    let opts = attention::AttentionOptions {
        variant: None,
        stream: c.stream(),
        layout,
        scale: (o.scale != 0.0).then_some(o.scale),
        causal: o.causal,
        window: (o.window_left, o.window_right),
        softcap: o.softcap,
        deterministic: o.deterministic,
    };
    // SAFETY: forwarded to this function's contract.
    let vl = match unsafe { read_opts(op, "varlen", varlen)? } {
        None => None,
        Some(v) => Some(VarlenOps {
            max_q: size(op, "varlen.max_seqlen_q", v.max_seqlen_q)?,
            max_k: size(op, "varlen.max_seqlen_k", v.max_seqlen_k)?,
            // SAFETY: forwarded to this function's contract.
            q: unsafe { c.tensor("varlen.cu_seqlens_q", v.cu_seqlens_q)? },
            // SAFETY: as above.
            k: unsafe { c.tensor("varlen.cu_seqlens_k", v.cu_seqlens_k)? },
        }),
    };
    Ok((opts, vl))
}

/// Attention forward (FlashAttention semantics): o = softmax(mask(softcap(scale·q·kᵀ)))·v and lse
/// (natural log, f32 `[B, Hq, Sq]`, or `[Hq, total_q]` for a varlen batch). q `[B, Sq, Hq, D]`
/// (bshd) or `[B, Hq, Sq, D]` (bhsd), k and v with Hkv heads (GQA: Hq a multiple of Hkv) and Sk
/// keys, o like q; f32, f16 or bf16. `varlen`, `options` may be NULL.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_attention_forward(
    device: FerriteDevice,
    q: *const FerriteTensor,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    varlen: *const FerriteVarlen,
    options: *const FerriteAttentionOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_attention_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (q, k, v, o, lse) = unsafe {
            (
                c.tensor("q", q)?,
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("o", o)?,
                c.tensor("lse", lse)?,
            )
        };
        // SAFETY: this function's contract.
        let (opts, vl) = unsafe { attention_args(&mut c, options, varlen)? };
        let vl_ref = vl.as_ref().map(VarlenOps::get);
        attention::attention_forward_into(&q.t, &k.t, &v.t, &o.t, &lse.t, vl_ref.as_ref(), &opts)?;
        write_back_all(&[Some(&o), Some(&lse)])
    })
}

/// Attention backward: dq, dk, dv (like q, k, v, with their strides) from dout (like o, with o's
/// strides), q, k, v, o and the forward's lse; the probabilities are recomputed.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_attention_backward(
    device: FerriteDevice,
    dout: *const FerriteTensor,
    q: *const FerriteTensor,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    dq: *const FerriteTensor,
    dk: *const FerriteTensor,
    dv: *const FerriteTensor,
    varlen: *const FerriteVarlen,
    options: *const FerriteAttentionOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_attention_backward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (dout, q, k, v, o, lse, dq, dk, dv) = unsafe {
            (
                c.tensor("dout", dout)?,
                c.tensor("q", q)?,
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("o", o)?,
                c.tensor("lse", lse)?,
                c.tensor("dq", dq)?,
                c.tensor("dk", dk)?,
                c.tensor("dv", dv)?,
            )
        };
        // SAFETY: this function's contract.
        let (opts, vl) = unsafe { attention_args(&mut c, options, varlen)? };
        let vl_ref = vl.as_ref().map(VarlenOps::get);
        attention::attention_backward_into(
            &dout.t,
            &q.t,
            &k.t,
            &v.t,
            &o.t,
            &lse.t,
            &dq.t,
            &dk.t,
            &dv.t,
            vl_ref.as_ref(),
            &opts,
        )?;
        write_back_all(&[Some(&dq), Some(&dk), Some(&dv)])
    })
}

// ---------------------------------------------------------------------------------------------
// decode

/// Options of `ferrite_paged_decode` (`ferrite_decode_options_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteDecodeOptions {
    /// Score scale; 0: 1/√head_dim (0).
    pub scale: f32,
    /// Soft-cap; 0: off (0).
    pub softcap: f32,
    /// Keys j ≥ len − 1 − window_left are visible; −1: all (−1).
    pub window_left: i64,
    /// CUDA `split_kv`: context partitions; 0: from the SM count (0).
    pub num_splits: i64,
}

/// scale 1/√D, no soft-cap, no window, partitions chosen by ferrite.
#[no_mangle]
pub extern "C" fn ferrite_decode_options_default() -> FerriteDecodeOptions {
    FerriteDecodeOptions {
        scale: 0.0,
        softcap: 0.0,
        window_left: -1,
        num_splits: 0,
    }
}

/// One decode step over a paged KV cache (vLLM's layout): q `[B, Hq, D]`, key_cache and
/// value_cache `[num_blocks, block_size, Hkv, D]`, block_table int32 `[B, max_blocks]`, seq_lens
/// int32 `[B]`; o like q, lse f32 `[B, Hq]` (optional). Bad indices are errors (on CUDA found by
/// the kernels and read back: one small copy and a synchronisation of the stream).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_paged_decode(
    device: FerriteDevice,
    q: *const FerriteTensor,
    key_cache: *const FerriteTensor,
    value_cache: *const FerriteTensor,
    block_table: *const FerriteTensor,
    seq_lens: *const FerriteTensor,
    o: *const FerriteTensor,
    lse: *const FerriteTensor,
    options: *const FerriteDecodeOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_paged_decode";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let opt = unsafe { read_opts(OP, "options", options)? }
            .unwrap_or_else(|| ferrite_decode_options_default());
        // SAFETY: this function's contract.
        let (q, kc, vc, table, lens, o, lse) = unsafe {
            (
                c.tensor("q", q)?,
                c.tensor("key_cache", key_cache)?,
                c.tensor("value_cache", value_cache)?,
                c.tensor("block_table", block_table)?,
                c.tensor("seq_lens", seq_lens)?,
                c.tensor("o", o)?,
                c.opt_tensor("lse", lse)?,
            )
        };
        let opts = decode::DecodeOptions {
            variant: None,
            stream: c.stream(),
            scale: (opt.scale != 0.0).then_some(opt.scale),
            softcap: opt.softcap,
            window_left: opt.window_left,
            num_splits: match size(OP, "options.num_splits", opt.num_splits)? {
                0 => None,
                n => Some(n),
            },
        };
        let kv = decode::PagedKv {
            key_cache: &kc.t,
            value_cache: &vc.t,
            block_table: &table.t,
            seq_lens: &lens.t,
        };
        decode::decode_into(&q.t, &kv, &o.t, opt_ref(&lse), &opts)?;
        write_back_all(&[Some(&o), lse.as_ref()])
    })
}

/// Writes k, v `[T, Hkv, D]` into the paged caches at slot_mapping (int32 `[T]`; slot =
/// block·block_size + offset; −1 skips a token). The caches are updated in place.
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_append_kv(
    device: FerriteDevice,
    k: *const FerriteTensor,
    v: *const FerriteTensor,
    key_cache: *const FerriteTensor,
    value_cache: *const FerriteTensor,
    slot_mapping: *const FerriteTensor,
) -> FerriteStatus {
    const OP: &str = "ferrite_append_kv";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let (k, v, kc, vc, slots) = unsafe {
            (
                c.tensor("k", k)?,
                c.tensor("v", v)?,
                c.tensor("key_cache", key_cache)?,
                c.tensor("value_cache", value_cache)?,
                c.tensor("slot_mapping", slot_mapping)?,
            )
        };
        let opts = decode::AppendOptions { stream: c.stream() };
        decode::append_kv(&k.t, &v.t, &kc.t, &vc.t, &slots.t, &opts)?;
        write_back_all(&[Some(&kc), Some(&vc)])
    })
}

// ---------------------------------------------------------------------------------------------
// AdamW

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

// ---------------------------------------------------------------------------------------------
// mixture of experts

/// The routing and experts of `ferrite_moe_forward` (`ferrite_moe_options_default()`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerriteMoeOptions {
    /// Experts per token (2).
    pub top_k: i64,
    /// A `FERRITE_MOE_SCORE_*` code (softmax).
    pub score: FerriteMoeScore,
    /// The chosen experts' weights renormalised to sum 1 (true).
    pub renormalize: bool,
    /// Expert groups for group-limited routing; 1: none (1).
    pub groups: i64,
    /// Groups a token may use (1).
    pub topk_groups: i64,
    /// Multiplies the routing weights (1).
    pub routed_scale: f32,
    /// Each expert keeps at most ceil(T·k/E·factor) tokens; 0: dropless (0).
    pub capacity_factor: f32,
    /// Coefficient of the auxiliary load-balancing loss (reported in `losses`) (0).
    pub aux_loss_coef: f32,
    /// Coefficient of the router z-loss (0).
    pub z_loss_coef: f32,
    /// The experts' gate activation: silu (SwiGLU), gelu_tanh / gelu_erf (GEGLU), relu (silu).
    pub activation: FerriteActivation,
}

/// top-2 softmax routing, renormalised, no groups, dropless, SwiGLU experts, no losses.
#[no_mangle]
pub extern "C" fn ferrite_moe_options_default() -> FerriteMoeOptions {
    FerriteMoeOptions {
        top_k: 2,
        score: FERRITE_MOE_SCORE_SOFTMAX,
        renormalize: true,
        groups: 1,
        topk_groups: 1,
        routed_scale: 1.0,
        capacity_factor: 0.0,
        aux_loss_coef: 0.0,
        z_loss_coef: 0.0,
        activation: crate::FERRITE_ACTIVATION_SILU,
    }
}

/// A mixture-of-experts layer's forward for inference: x `[T, H]`, router `[E, H]`, w_up
/// `[E, H, 2I]` (gate columns first), w_down `[E, I, H]`, one dtype (f32, f16, bf16), all
/// contiguous; out `[T, H]`; `losses` (optional) f32 `[2 + E]`: the aux loss, the z-loss and each
/// expert's mean score. The routing and the experts' activations live in buffers ferrite
/// allocates for the call (on CUDA in stream order on the call's stream).
///
/// # Safety
/// See the pointer contract at the top of this header.
#[no_mangle]
pub unsafe extern "C" fn ferrite_moe_forward(
    device: FerriteDevice,
    x: *const FerriteTensor,
    router: *const FerriteTensor,
    w_up: *const FerriteTensor,
    w_down: *const FerriteTensor,
    out: *const FerriteTensor,
    losses: *const FerriteTensor,
    options: *const FerriteMoeOptions,
) -> FerriteStatus {
    const OP: &str = "ferrite_moe_forward";
    call(OP, || {
        let mut c = Call::new(OP, device)?;
        // SAFETY: this function's contract.
        let o = unsafe { read_opts(OP, "options", options)? }
            .ok_or_else(|| bad(OP, "options", "a FerriteMoeOptions", "a null pointer"))?;
        // SAFETY: this function's contract.
        let (x, router, w_up, w_down, out, losses) = unsafe {
            (
                c.tensor("x", x)?,
                c.tensor("router", router)?,
                c.tensor("w_up", w_up)?,
                c.tensor("w_down", w_down)?,
                c.tensor("out", out)?,
                c.opt_tensor("losses", losses)?,
            )
        };
        let score = match o.score.0 {
            0 => moe::Score::Softmax,
            1 => moe::Score::Sigmoid,
            other => {
                return Err(bad(
                    OP,
                    "options.score",
                    "a FERRITE_MOE_SCORE_* code (0 softmax, 1 sigmoid)",
                    other,
                ))
            }
        };
        let cfg = moe::MoeConfig {
            experts: router.t.shape().first().copied().unwrap_or(0),
            top_k: size(OP, "options.top_k", o.top_k)?,
            score,
            renormalize: o.renormalize,
            groups: size(OP, "options.groups", o.groups)?,
            topk_groups: size(OP, "options.topk_groups", o.topk_groups)?,
            routed_scale: o.routed_scale,
            capacity_factor: (o.capacity_factor != 0.0).then_some(o.capacity_factor),
            aux_loss_coef: o.aux_loss_coef,
            z_loss_coef: o.z_loss_coef,
            act: activation_of(OP, "options.activation", o.activation)?,
        };
        let w = moe::MoeWeights {
            router: &router.t,
            w_up: &w_up.t,
            w_down: &w_down.t,
        };
        let p = moe::validate(&x.t, &w, &cfg)?;
        let mut bufs: Vec<Tensor> = Vec::with_capacity(moe::FORWARD_BUFFERS);
        for (name, shape, dtype) in moe::MoeForward::layout(&p) {
            bufs.push(match (name, &losses) {
                ("out", _) => out.t.clone(),
                ("losses", Some(l)) => l.t.clone(),
                _ => c.scratch(&shape, dtype)?,
            });
        }
        let bufs: [Tensor; moe::FORWARD_BUFFERS] = bufs.try_into().map_err(|_| {
            Error::Other(format!(
                "{OP}: the forward's buffer list changed its length"
            ))
        })?;
        let f = moe::MoeForward::from_buffers(&p, bufs)?;
        let opts = moe::MoeOptions {
            variant: None,
            stream: c.stream(),
            forward_only: true,
        };
        moe::moe_forward_into(&x.t, &w, &cfg, &f, &opts)?;
        // The scratch buffers are freed here, in stream order after the layer's kernels.
        drop(f);
        write_back_all(&[Some(&out), losses.as_ref()])
    })
}
