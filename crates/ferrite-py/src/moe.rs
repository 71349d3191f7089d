//! The mixture-of-experts layer and grouped_mm for the Python layer: descriptors in, every buffer
//! (outputs, the forward's saved routing and activations, gradients) allocated by Python, CUDA
//! work on torch's stream, CPU outputs copied back.

use crate::{run, target, wrap, Desc, Operand};
use ferrite::ops::activation::Activation;
use ferrite::ops::moe::{
    self as fmoe, MoeConfig, MoeForward, MoeGrads, MoeOptions, MoeWeights, Score,
};
use pyo3::prelude::*;

#[allow(clippy::too_many_arguments)]
fn config(
    experts: usize,
    top_k: usize,
    score: &str,
    renormalize: bool,
    groups: usize,
    topk_groups: usize,
    routed_scale: f64,
    capacity_factor: Option<f64>,
    aux_loss_coef: f64,
    z_loss_coef: f64,
    activation: &str,
) -> ferrite::Result<MoeConfig> {
    Ok(MoeConfig {
        experts,
        top_k,
        score: Score::parse(score)?,
        renormalize,
        groups,
        topk_groups,
        routed_scale: routed_scale as f32,
        capacity_factor: capacity_factor.map(|f| f as f32),
        aux_loss_coef: aux_loss_coef as f32,
        z_loss_coef: z_loss_coef as f32,
        act: Activation::parse_arg("ferrite.moe", "activation", activation)?,
    })
}

fn wrap_all(
    op: &str,
    names: &[&str],
    ds: &[Desc],
    tgt: &crate::Target,
) -> ferrite::Result<Vec<Operand>> {
    names
        .iter()
        .zip(ds)
        .map(|(n, d)| wrap(op, n, d, tgt))
        .collect()
}

const SAVED: [&str; fmoe::FORWARD_BUFFERS] = [
    "out", "logits", "probs", "lse", "idx", "weights", "pos", "src", "ends", "counts", "stats",
    "losses", "xp", "hpre",
];

/// The saved buffers as a MoeForward of the layer x / weights describe.
fn forward_of(
    ops: &[Operand],
    x: &ferrite::Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
) -> ferrite::Result<MoeForward> {
    let p = fmoe::validate(x, w, cfg)?;
    let ts: [ferrite::Tensor; fmoe::FORWARD_BUFFERS] = std::array::from_fn(|i| ops[i].t.clone());
    MoeForward::from_buffers(&p, ts)
}

/// The layer's forward into the buffers of `saved` (MoeForward's fields, in order);
/// `forward_only`: no backward will read them (the pre-activations may be left unwritten).
#[pyfunction]
#[pyo3(signature = (x, router, w_up, w_down, saved, top_k, score="softmax", renormalize=true, groups=1, topk_groups=1, routed_scale=1.0, capacity_factor=None, aux_loss_coef=0.0, z_loss_coef=0.0, activation="silu", device=-1, stream=0, variant=None, forward_only=false))]
#[allow(clippy::too_many_arguments)]
pub fn moe_forward(
    py: Python<'_>,
    x: Desc,
    router: Desc,
    w_up: Desc,
    w_down: Desc,
    saved: Vec<Desc>,
    top_k: usize,
    score: &str,
    renormalize: bool,
    groups: usize,
    topk_groups: usize,
    routed_scale: f64,
    capacity_factor: Option<f64>,
    aux_loss_coef: f64,
    z_loss_coef: f64,
    activation: &str,
    device: i64,
    stream: u64,
    variant: Option<String>,
    forward_only: bool,
) -> PyResult<()> {
    const OP: &str = "ferrite.moe";
    let (score, activation) = (score.to_string(), activation.to_string());
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let ins = wrap_all(
            OP,
            &["x", "router", "w_up", "w_down"],
            &[x, router, w_up, w_down],
            &tgt,
        )?;
        if saved.len() != fmoe::FORWARD_BUFFERS {
            return Err(ferrite::Error::bad_arg(
                OP,
                "saved",
                format!("{} buffers", fmoe::FORWARD_BUFFERS),
                saved.len(),
            ));
        }
        let outs = wrap_all(OP, &SAVED, &saved, &tgt)?;
        let w = MoeWeights {
            router: &ins[1].t,
            w_up: &ins[2].t,
            w_down: &ins[3].t,
        };
        let experts = ins[1].t.shape().first().copied().unwrap_or(0);
        let cfg = config(
            experts,
            top_k,
            &score,
            renormalize,
            groups,
            topk_groups,
            routed_scale,
            capacity_factor,
            aux_loss_coef,
            z_loss_coef,
            &activation,
        )?;
        let f = forward_of(&outs, &ins[0].t, &w, &cfg)?;
        fmoe::moe_forward_into(
            &ins[0].t,
            &w,
            &cfg,
            &f,
            &MoeOptions {
                variant,
                stream: tgt.stream(),
                forward_only,
            },
        )?;
        outs.iter().try_for_each(|o| o.write_back())
    })
}

/// The layer's backward from dout and the forward's saved buffers into dx, d_router, dw_up,
/// dw_down; `loss_grad` (f32 [≥ 2], optional): the incoming gradients of the aux and z-losses.
#[pyfunction]
#[pyo3(signature = (dout, x, router, w_up, w_down, saved, grads, top_k, loss_grad=None, score="softmax", renormalize=true, groups=1, topk_groups=1, routed_scale=1.0, capacity_factor=None, aux_loss_coef=0.0, z_loss_coef=0.0, activation="silu", device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn moe_backward(
    py: Python<'_>,
    dout: Desc,
    x: Desc,
    router: Desc,
    w_up: Desc,
    w_down: Desc,
    saved: Vec<Desc>,
    grads: Vec<Desc>,
    top_k: usize,
    loss_grad: Option<Desc>,
    score: &str,
    renormalize: bool,
    groups: usize,
    topk_groups: usize,
    routed_scale: f64,
    capacity_factor: Option<f64>,
    aux_loss_coef: f64,
    z_loss_coef: f64,
    activation: &str,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.moe_backward";
    let (score, activation) = (score.to_string(), activation.to_string());
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let ins = wrap_all(
            OP,
            &["dout", "x", "router", "w_up", "w_down"],
            &[dout, x, router, w_up, w_down],
            &tgt,
        )?;
        if saved.len() != fmoe::FORWARD_BUFFERS || grads.len() != 4 {
            return Err(ferrite::Error::bad_arg(
                OP,
                "saved/grads",
                format!("{} saved buffers and 4 gradients", fmoe::FORWARD_BUFFERS),
                format!("{} and {}", saved.len(), grads.len()),
            ));
        }
        let sv = wrap_all(OP, &SAVED, &saved, &tgt)?;
        let gs = wrap_all(OP, &["dx", "d_router", "dw_up", "dw_down"], &grads, &tgt)?;
        let w = MoeWeights {
            router: &ins[2].t,
            w_up: &ins[3].t,
            w_down: &ins[4].t,
        };
        let experts = ins[2].t.shape().first().copied().unwrap_or(0);
        let cfg = config(
            experts,
            top_k,
            &score,
            renormalize,
            groups,
            topk_groups,
            routed_scale,
            capacity_factor,
            aux_loss_coef,
            z_loss_coef,
            &activation,
        )?;
        let f = forward_of(&sv, &ins[1].t, &w, &cfg)?;
        let g = MoeGrads {
            dx: gs[0].t.clone(),
            d_router: gs[1].t.clone(),
            dw_up: gs[2].t.clone(),
            dw_down: gs[3].t.clone(),
        };
        let lg = loss_grad
            .as_ref()
            .map(|d| wrap(OP, "loss_grad", d, &tgt))
            .transpose()?;
        fmoe::moe_backward_into(
            &ins[0].t,
            &ins[1].t,
            &w,
            &f,
            &cfg,
            &g,
            lg.as_ref().map(|o| &o.t),
            &MoeOptions {
                variant,
                stream: tgt.stream(),
                forward_only: false,
            },
        )?;
        gs.iter().try_for_each(|o| o.write_back())
    })
}

/// out[rows of g] = a[rows of g]·b[g] (torch._grouped_mm for 2-D a and 3-D b).
#[pyfunction]
#[pyo3(signature = (a, b, offs, out, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn grouped_mm(
    py: Python<'_>,
    a: Desc,
    b: Desc,
    offs: Desc,
    out: Desc,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.grouped_mm";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let t = wrap_all(OP, &["a", "b", "offs", "out"], &[a, b, offs, out], &tgt)?;
        fmoe::grouped_mm(
            &t[0].t,
            &t[1].t,
            &t[2].t,
            &t[3].t,
            &MoeOptions {
                variant,
                stream: tgt.stream(),
                forward_only: false,
            },
        )?;
        t[3].write_back()
    })
}

/// db[g] = a[rows of g]ᵀ·dout[rows of g]: grouped_mm's gradient with respect to b.
#[pyfunction]
#[pyo3(signature = (a, dout, offs, db, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn grouped_mm_weight_grad(
    py: Python<'_>,
    a: Desc,
    dout: Desc,
    offs: Desc,
    db: Desc,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.grouped_mm_backward";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let t = wrap_all(OP, &["a", "dout", "offs", "db"], &[a, dout, offs, db], &tgt)?;
        fmoe::grouped_mm_weight_grad(
            &t[0].t,
            &t[1].t,
            &t[2].t,
            &t[3].t,
            &MoeOptions {
                variant,
                stream: tgt.stream(),
                forward_only: false,
            },
        )?;
        t[3].write_back()
    })
}
