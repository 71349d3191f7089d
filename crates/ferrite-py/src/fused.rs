//! The training ops beyond matmul and the norms: linear with fused epilogues, softmax, bias +
//! activation + dropout, the gated units (SwiGLU / GEGLU), fused cross-entropy and the AdamW step.
//! Same conventions as the crate root: descriptors in, outputs allocated by the Python layer,
//! CUDA work on torch's stream, CPU operands copied in and outputs copied back.

use crate::{opt_ref, run, target, wrap, wrap_opt, write_back_all, Desc};
use ferrite::core::harness::Precision;
use ferrite::ops::activation::{
    self as fact, ActOptions, Activation, Dropout as FDropout, GluOptions,
};
use ferrite::ops::adamw::{self as fadamw, AdamWHyper, AdamWOptions, AdamWTensor};
use ferrite::ops::cross_entropy::{self as fce, CrossEntropyOptions, GradOut, Reduction};
use ferrite::ops::linear::{self as flinear, LinearOptions};
use ferrite::ops::rotary::{self as frotary, RotaryOptions};
use ferrite::ops::softmax::{self as fsoftmax, SoftmaxOptions};
use ferrite::Error;
use pyo3::prelude::*;

fn activation(op: &str, name: &str) -> ferrite::Result<Activation> {
    Activation::parse_arg(op, "activation", name)
}

fn parse_activation(op: &str, arg: &str, act: &str) -> ferrite::Result<Activation> {
    Activation::parse_arg(op, arg, act)
}

fn linear_options(
    op: &str,
    act: &str,
    tf32: bool,
    variant: Option<String>,
    tgt: &crate::Target,
) -> ferrite::Result<LinearOptions> {
    Ok(LinearOptions {
        variant,
        activation: parse_activation(op, "activation", act)?,
        precision: if tf32 {
            Precision::Tf32
        } else {
            Precision::F32
        },
        stream: tgt.stream(),
        threads: 0,
    })
}

/// y = act(x·wᵀ + bias) (+ residual) and, when `z` is given, the pre-activation z = x·wᵀ + bias
/// (ferrite's `linear::forward_into`: the bias, activation and residual run in the GEMM's
/// epilogue). x: [rows, in], w: [out, in], y/z/residual: [rows, out].
#[pyfunction]
#[pyo3(signature = (x, w, y, bias=None, residual=None, z=None, activation="none", tf32=false, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    py: Python<'_>,
    x: Desc,
    w: Desc,
    y: Desc,
    bias: Option<Desc>,
    residual: Option<Desc>,
    z: Option<Desc>,
    activation: &str,
    tf32: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.linear";
    let act = activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = linear_options(OP, &act, tf32, variant, &tgt)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let w = wrap(OP, "weight", &w, &tgt)?;
        let y = wrap(OP, "y", &y, &tgt)?;
        let bias = wrap_opt(OP, "bias", &bias, &tgt)?;
        let residual = wrap_opt(OP, "residual", &residual, &tgt)?;
        let z = wrap_opt(OP, "z", &z, &tgt)?;
        flinear::forward_into(
            &flinear::Fwd {
                x: &x.t,
                w: &w.t,
                bias: opt_ref(&bias),
                residual: opt_ref(&residual),
            },
            &flinear::FwdOut {
                y: &y.t,
                z: opt_ref(&z),
            },
            &opts,
        )?;
        write_back_all(&[Some(&y), z.as_ref()])
    })
}

/// dx, dw, db of `linear_forward` (ferrite's `linear::backward_into`: the activation's backward
/// fused with the deterministic db reduction, then two GEMMs). `z` is required unless the
/// activation is none; any output may be left out.
/// The chain form: with `x_pre` (the input's own pre-activation, x = x_pre_activation(x_pre),
/// the layer below's), `dx` receives that layer's dZ = dX ⊙ act'(x_pre), formed in the dX
/// GEMM's epilogue, and `db_pre` (with `dx`) that layer's bias gradient, its column sums.
#[pyfunction]
#[pyo3(signature = (dy, x, w, z=None, dx=None, dw=None, db=None, activation="none", tf32=false, device=-1, stream=0, variant=None, x_pre=None, x_pre_activation="none", db_pre=None))]
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    py: Python<'_>,
    dy: Desc,
    x: Desc,
    w: Desc,
    z: Option<Desc>,
    dx: Option<Desc>,
    dw: Option<Desc>,
    db: Option<Desc>,
    activation: &str,
    tf32: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
    x_pre: Option<Desc>,
    x_pre_activation: &str,
    db_pre: Option<Desc>,
) -> PyResult<()> {
    const OP: &str = "ferrite.linear_backward";
    let act = activation.to_string();
    let act_pre = x_pre_activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = linear_options(OP, &act, tf32, variant, &tgt)?;
        let pre_act = parse_activation(OP, "x_pre_activation", &act_pre)?;
        let x_pre = wrap_opt(OP, "x_pre", &x_pre, &tgt)?;
        let db_pre = wrap_opt(OP, "db_pre", &db_pre, &tgt)?;
        let dy = wrap(OP, "dy", &dy, &tgt)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let w = wrap(OP, "weight", &w, &tgt)?;
        let z = wrap_opt(OP, "z", &z, &tgt)?;
        let dx = wrap_opt(OP, "dx", &dx, &tgt)?;
        let dw = wrap_opt(OP, "dw", &dw, &tgt)?;
        let db = wrap_opt(OP, "db", &db, &tgt)?;
        flinear::backward_into(
            &flinear::Bwd {
                dy: &dy.t,
                x: &x.t,
                w: &w.t,
                z: opt_ref(&z),
                x_pre: opt_ref(&x_pre).map(|t| (t, pre_act)),
            },
            &flinear::BwdOut {
                dx: opt_ref(&dx),
                dw: opt_ref(&dw),
                db: opt_ref(&db),
                db_pre: opt_ref(&db_pre),
            },
            &opts,
        )?;
        write_back_all(&[dx.as_ref(), dw.as_ref(), db.as_ref(), db_pre.as_ref()])
    })
}

/// y = softmax(scale·x) over the last dim (contiguous x and y of one shape).
#[pyfunction]
#[pyo3(signature = (x, y, scale=1.0, device=-1, stream=0, variant=None))]
pub fn softmax_forward(
    py: Python<'_>,
    x: Desc,
    y: Desc,
    scale: f32,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.softmax";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let y = wrap(OP, "y", &y, &tgt)?;
        let opts = SoftmaxOptions {
            variant,
            scale,
            stream: tgt.stream(),
        };
        fsoftmax::softmax_into(&x.t, &y.t, &opts)?;
        y.write_back()
    })
}

/// dx = scale · y ⊙ (dy − Σ dy⊙y) from the forward's output y.
#[pyfunction]
#[pyo3(signature = (dy, y, dx, scale=1.0, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn softmax_backward(
    py: Python<'_>,
    dy: Desc,
    y: Desc,
    dx: Desc,
    scale: f32,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.softmax_backward";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let dy = wrap(OP, "dy", &dy, &tgt)?;
        let y = wrap(OP, "y", &y, &tgt)?;
        let dx = wrap(OP, "dx", &dx, &tgt)?;
        let opts = SoftmaxOptions {
            variant,
            scale,
            stream: tgt.stream(),
        };
        fsoftmax::softmax_backward_into(&dy.t, &y.t, &dx.t, &opts)?;
        dx.write_back()
    })
}

fn act_options(
    op: &str,
    act: &str,
    p: f32,
    seed: u64,
    offset: u64,
    variant: Option<String>,
    tgt: &crate::Target,
) -> ferrite::Result<ActOptions> {
    Ok(ActOptions {
        variant,
        stream: tgt.stream(),
        act: activation(op, act)?,
        dropout: FDropout { p, seed, offset },
    })
}

/// y = dropout(act(x + bias)) with the counter-based RNG stream (seed, offset): the same mask on
/// the CPU and the GPU, regenerated by the backward instead of stored.
#[pyfunction]
#[pyo3(signature = (x, y, bias=None, activation="none", p=0.0, seed=0, offset=0, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn bias_act_dropout(
    py: Python<'_>,
    x: Desc,
    y: Desc,
    bias: Option<Desc>,
    activation: &str,
    p: f32,
    seed: u64,
    offset: u64,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.bias_act_dropout";
    let act = activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = act_options(OP, &act, p, seed, offset, variant, &tgt)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let y = wrap(OP, "y", &y, &tgt)?;
        let bias = wrap_opt(OP, "bias", &bias, &tgt)?;
        fact::bias_act_dropout_into(&x.t, opt_ref(&bias), &y.t, &opts)?;
        y.write_back()
    })
}

/// dx (and dbias, reduced deterministically) of `bias_act_dropout` with the same options.
#[pyfunction]
#[pyo3(signature = (dy, x, dx, bias=None, dbias=None, activation="none", p=0.0, seed=0, offset=0, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn bias_act_dropout_backward(
    py: Python<'_>,
    dy: Desc,
    x: Desc,
    dx: Desc,
    bias: Option<Desc>,
    dbias: Option<Desc>,
    activation: &str,
    p: f32,
    seed: u64,
    offset: u64,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.bias_act_dropout_backward";
    let act = activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = act_options(OP, &act, p, seed, offset, variant, &tgt)?;
        let dy = wrap(OP, "dy", &dy, &tgt)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let dx = wrap(OP, "dx", &dx, &tgt)?;
        let bias = wrap_opt(OP, "bias", &bias, &tgt)?;
        let dbias = wrap_opt(OP, "dbias", &dbias, &tgt)?;
        fact::bias_act_dropout_backward_into(
            &dy.t,
            &x.t,
            opt_ref(&bias),
            &dx.t,
            opt_ref(&dbias),
            &opts,
        )?;
        write_back_all(&[Some(&dx), dbias.as_ref()])
    })
}

/// out = act(gate) ⊙ up for input = [gate | up] along the last dim (SwiGLU: silu, GEGLU: gelu).
#[pyfunction]
#[pyo3(signature = (input, out, activation="silu", device=-1, stream=0, variant=None))]
pub fn glu_forward(
    py: Python<'_>,
    input: Desc,
    out: Desc,
    activation: &str,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.glu";
    let act = activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = GluOptions {
            variant,
            stream: tgt.stream(),
            act: self::activation(OP, &act)?,
        };
        let input = wrap(OP, "input", &input, &tgt)?;
        let out = wrap(OP, "out", &out, &tgt)?;
        fact::glu_into(&input.t, &out.t, &opts)?;
        out.write_back()
    })
}

/// d(input) of `glu_forward` from dout and the forward's input.
#[pyfunction]
#[pyo3(signature = (dout, input, dinput, activation="silu", device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn glu_backward(
    py: Python<'_>,
    dout: Desc,
    input: Desc,
    dinput: Desc,
    activation: &str,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.glu_backward";
    let act = activation.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = GluOptions {
            variant,
            stream: tgt.stream(),
            act: self::activation(OP, &act)?,
        };
        let dout = wrap(OP, "dout", &dout, &tgt)?;
        let input = wrap(OP, "input", &input, &tgt)?;
        let dinput = wrap(OP, "dinput", &dinput, &tgt)?;
        fact::glu_backward_into(&dout.t, &input.t, &dinput.t, &opts)?;
        dinput.write_back()
    })
}

fn reduction(op: &str, name: &str) -> ferrite::Result<Reduction> {
    match name {
        "mean" => Ok(Reduction::Mean),
        "sum" => Ok(Reduction::Sum),
        "none" => Ok(Reduction::None),
        other => Err(Error::bad_arg(op, "reduction", "mean, sum or none", other)),
    }
}

/// Fused softmax cross-entropy: per-row losses (f32 [N]), the reduced loss (f32 [1]) when asked,
/// and dlogits (scaled by `dloss` and the reduction) into `grad` when given — one pass over the
/// logits for the loss and one for the gradient, the probabilities never stored.
#[pyfunction]
#[pyo3(signature = (logits, targets, loss_rows, loss=None, grad=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", dloss=1.0, check_targets=true, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    py: Python<'_>,
    logits: Desc,
    targets: Desc,
    loss_rows: Desc,
    loss: Option<Desc>,
    grad: Option<Desc>,
    ignore_index: i64,
    label_smoothing: f32,
    reduction: &str,
    dloss: f32,
    check_targets: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.cross_entropy";
    let red = reduction.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = CrossEntropyOptions {
            variant,
            stream: tgt.stream(),
            ignore_index,
            label_smoothing,
            reduction: self::reduction(OP, &red)?,
            dloss,
            check_targets,
            cluster: None,
        };
        let logits = wrap(OP, "logits", &logits, &tgt)?;
        let targets = wrap(OP, "targets", &targets, &tgt)?;
        let loss_rows = wrap(OP, "loss_rows", &loss_rows, &tgt)?;
        let loss = wrap_opt(OP, "loss", &loss, &tgt)?;
        let grad = wrap_opt(OP, "grad", &grad, &tgt)?;
        let g = match &grad {
            Some(g) => GradOut::Into(&g.t),
            None => GradOut::Skip,
        };
        fce::cross_entropy_into(
            &logits.t,
            &targets.t,
            &loss_rows.t,
            opt_ref(&loss),
            g,
            &opts,
        )?;
        write_back_all(&[Some(&loss_rows), loss.as_ref(), grad.as_ref()])
    })
}

/// (param, grad, exp_avg, exp_avg_sq, master or None) of one tensor.
type AdamWDescs = (Desc, Desc, Desc, Desc, Option<Desc>);

/// One fused AdamW step over many tensors, in place (params, moments and master weights), one
/// launch on the GPU (ferrite's `adamw::adamw_step`).
#[pyfunction]
#[pyo3(signature = (tensors, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, step=1, grad_scale=1.0, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    py: Python<'_>,
    tensors: Vec<AdamWDescs>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    grad_scale: f64,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.adamw_step";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let mut wrapped = Vec::with_capacity(tensors.len());
        for (i, (p, g, m, v, master)) in tensors.iter().enumerate() {
            let arg = |s: &str| format!("tensors[{i}].{s}");
            wrapped.push((
                wrap(OP, &arg("param"), p, &tgt)?,
                wrap(OP, &arg("grad"), g, &tgt)?,
                wrap(OP, &arg("exp_avg"), m, &tgt)?,
                wrap(OP, &arg("exp_avg_sq"), v, &tgt)?,
                wrap_opt(OP, &arg("master"), master, &tgt)?,
            ));
        }
        let list: Vec<AdamWTensor> = wrapped
            .iter()
            .map(|(p, g, m, v, master)| AdamWTensor {
                param: &p.t,
                grad: &g.t,
                exp_avg: &m.t,
                exp_avg_sq: &v.t,
                master: opt_ref(master),
            })
            .collect();
        let hp = AdamWHyper {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            grad_scale,
        };
        let opts = AdamWOptions {
            variant,
            stream: tgt.stream(),
        };
        fadamw::adamw_step(&list, &hp, &opts)?;
        for (p, _, m, v, master) in &wrapped {
            write_back_all(&[Some(p), Some(m), Some(v), master.as_ref()])?;
        }
        Ok(())
    })
}

/// out = x with rotary position embeddings applied (out may be x: in place). x [B, S, H, D] (or
/// [T, H, D] with cu_seqlens), cos/sin [S_ro, R/2]; `offsets` int32 [B] or one `offset`.
#[pyfunction]
#[pyo3(signature = (x, cos, sin, out, offset=0, offsets=None, cu_seqlens=None, interleaved=false, conjugate=false, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn rotary(
    py: Python<'_>,
    x: Desc,
    cos: Desc,
    sin: Desc,
    out: Desc,
    offset: i64,
    offsets: Option<Desc>,
    cu_seqlens: Option<Desc>,
    interleaved: bool,
    conjugate: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.apply_rotary_emb";
    run(py, OP, move || {
        if offset < 0 {
            return Err(Error::bad_arg(
                OP,
                "seqlen_offsets",
                "a non-negative offset",
                offset,
            ));
        }
        let tgt = target(OP, device, stream)?;
        let x = wrap(OP, "x", &x, &tgt)?;
        let cos = wrap(OP, "cos", &cos, &tgt)?;
        let sin = wrap(OP, "sin", &sin, &tgt)?;
        let out = wrap(OP, "out", &out, &tgt)?;
        let offsets = wrap_opt(OP, "seqlen_offsets", &offsets, &tgt)?;
        let cu = wrap_opt(OP, "cu_seqlens", &cu_seqlens, &tgt)?;
        let opts = RotaryOptions {
            variant,
            interleaved,
            conjugate,
            offset: offset as usize,
            offsets: offsets.map(|o| o.t),
            cu_seqlens: cu.map(|c| c.t),
            stream: tgt.stream(),
        };
        frotary::rotary_into(&x.t, &cos.t, &sin.t, &out.t, &opts)?;
        out.write_back()
    })
}

/// grad *= dloss in place (one element, or one per row): the loss's incoming gradient folded into
/// the dlogits the forward computed; on CUDA a dloss of 1 costs no pass over grad.
#[pyfunction]
#[pyo3(signature = (grad, dloss, device=-1, stream=0))]
pub fn cross_entropy_scale_grad(
    py: Python<'_>,
    grad: Desc,
    dloss: Desc,
    device: i64,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "ferrite.cross_entropy";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let g = wrap(OP, "grad", &grad, &tgt)?;
        let d = wrap(OP, "dloss", &dloss, &tgt)?;
        fce::scale_grad_in_place(&g.t, &d.t, tgt.stream())?;
        g.write_back()
    })
}
