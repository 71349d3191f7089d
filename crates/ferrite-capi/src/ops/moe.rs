//! The mixture-of-experts layer's forward.

use super::{activation_of, read_opts, size};
use crate::boundary::call;
use crate::operand::{bad, write_back_all, Call};
use crate::{
    FerriteActivation, FerriteDevice, FerriteMoeScore, FerriteStatus, FerriteTensor,
    FERRITE_MOE_SCORE_SOFTMAX,
};
use ferrite::ops::moe;
use ferrite::{Error, Tensor};

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
