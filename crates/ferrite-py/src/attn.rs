//! Attention (flash forward/backward: causal, window, GQA, varlen, soft-cap, both layouts) and
//! paged-KV decode with its cache append. Conventions as in the crate root.

use crate::{parse_dtype, run, run_value, target, wrap, wrap_opt, Desc, Operand, Target};
use ferrite::ops::attention::{self as fattn, AttentionOptions, Layout, Varlen};
use ferrite::ops::decode::{self as fdecode, AppendOptions, DecodeOptions, PagedKv, PlanShape};
use ferrite::{Device, Error};
use pyo3::prelude::*;

fn layout(op: &str, name: &str) -> ferrite::Result<Layout> {
    match name {
        "bshd" => Ok(Layout::Bshd),
        "bhsd" => Ok(Layout::Bhsd),
        other => Err(Error::bad_arg(op, "layout", "bshd or bhsd", other)),
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_options(
    op: &str,
    tgt: &Target,
    layout_name: &str,
    scale: Option<f32>,
    causal: bool,
    window: (i64, i64),
    softcap: f32,
    deterministic: bool,
    variant: Option<String>,
) -> ferrite::Result<AttentionOptions> {
    Ok(AttentionOptions {
        variant,
        stream: tgt.stream(),
        layout: layout(op, layout_name)?,
        scale,
        causal,
        window,
        softcap,
        deterministic,
    })
}

/// The cumulative sequence lengths of a varlen call, both or neither.
fn varlen_operands(
    op: &str,
    cu_q: &Option<Desc>,
    cu_k: &Option<Desc>,
    tgt: &Target,
) -> ferrite::Result<Option<(Operand, Operand)>> {
    match (
        wrap_opt(op, "cu_seqlens_q", cu_q, tgt)?,
        wrap_opt(op, "cu_seqlens_k", cu_k, tgt)?,
    ) {
        (Some(q), Some(k)) => Ok(Some((q, k))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(Error::bad_arg(
            op,
            "cu_seqlens_k",
            "a tensor (cu_seqlens_q is given)",
            "None",
        )),
        (None, Some(_)) => Err(Error::bad_arg(
            op,
            "cu_seqlens_q",
            "a tensor (cu_seqlens_k is given)",
            "None",
        )),
    }
}

/// Attention forward into caller-provided o (like q) and lse (f32 [B, Hq, Sq], or [Hq, total_q]
/// for a varlen batch given by cu_seqlens_q/k and max_seqlen_q/k).
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, layout="bshd", scale=None, causal=false, window_left=-1, window_right=-1, softcap=0.0, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    py: Python<'_>,
    q: Desc,
    k: Desc,
    v: Desc,
    o: Desc,
    lse: Desc,
    cu_seqlens_q: Option<Desc>,
    cu_seqlens_k: Option<Desc>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    layout: &str,
    scale: Option<f32>,
    causal: bool,
    window_left: i64,
    window_right: i64,
    softcap: f32,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.attention";
    let layout = layout.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = attention_options(
            OP,
            &tgt,
            &layout,
            scale,
            causal,
            (window_left, window_right),
            softcap,
            false,
            variant,
        )?;
        let q = wrap(OP, "q", &q, &tgt)?;
        let k = wrap(OP, "k", &k, &tgt)?;
        let v = wrap(OP, "v", &v, &tgt)?;
        let o = wrap(OP, "o", &o, &tgt)?;
        let lse = wrap(OP, "lse", &lse, &tgt)?;
        let cu = varlen_operands(OP, &cu_seqlens_q, &cu_seqlens_k, &tgt)?;
        let vl = cu.as_ref().map(|(cq, ck)| Varlen {
            cu_seqlens_q: &cq.t,
            cu_seqlens_k: &ck.t,
            max_seqlen_q,
            max_seqlen_k,
        });
        fattn::attention_forward_into(&q.t, &k.t, &v.t, &o.t, &lse.t, vl.as_ref(), &opts)?;
        o.write_back()?;
        lse.write_back()
    })
}

/// Attention backward into caller-provided dq, dk, dv (each with its partner's strides; dout
/// with o's), recomputing the probabilities from lse. `deterministic`: the same bits every run.
#[pyfunction]
#[pyo3(signature = (dout, q, k, v, o, lse, dq, dk, dv, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, layout="bshd", scale=None, causal=false, window_left=-1, window_right=-1, softcap=0.0, deterministic=false, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    py: Python<'_>,
    dout: Desc,
    q: Desc,
    k: Desc,
    v: Desc,
    o: Desc,
    lse: Desc,
    dq: Desc,
    dk: Desc,
    dv: Desc,
    cu_seqlens_q: Option<Desc>,
    cu_seqlens_k: Option<Desc>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    layout: &str,
    scale: Option<f32>,
    causal: bool,
    window_left: i64,
    window_right: i64,
    softcap: f32,
    deterministic: bool,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.attention_backward";
    let layout = layout.to_string();
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let opts = attention_options(
            OP,
            &tgt,
            &layout,
            scale,
            causal,
            (window_left, window_right),
            softcap,
            deterministic,
            variant,
        )?;
        let dout = wrap(OP, "dout", &dout, &tgt)?;
        let q = wrap(OP, "q", &q, &tgt)?;
        let k = wrap(OP, "k", &k, &tgt)?;
        let v = wrap(OP, "v", &v, &tgt)?;
        let o = wrap(OP, "o", &o, &tgt)?;
        let lse = wrap(OP, "lse", &lse, &tgt)?;
        let dq = wrap(OP, "dq", &dq, &tgt)?;
        let dk = wrap(OP, "dk", &dk, &tgt)?;
        let dv = wrap(OP, "dv", &dv, &tgt)?;
        let cu = varlen_operands(OP, &cu_seqlens_q, &cu_seqlens_k, &tgt)?;
        let vl = cu.as_ref().map(|(cq, ck)| Varlen {
            cu_seqlens_q: &cq.t,
            cu_seqlens_k: &ck.t,
            max_seqlen_q,
            max_seqlen_k,
        });
        fattn::attention_backward_into(
            &dout.t,
            &q.t,
            &k.t,
            &v.t,
            &o.t,
            &lse.t,
            &dq.t,
            &dk.t,
            &dv.t,
            vl.as_ref(),
            &opts,
        )?;
        for g in [&dq, &dk, &dv] {
            g.write_back()?;
        }
        Ok(())
    })
}

/// One decode step over a paged KV cache: q [B, Hq, D], caches [num_blocks, block_size, Hkv, D],
/// block_table i32 [B, max_blocks], seq_lens i32 [B]; o like q, lse f32 [B, Hq] when given.
/// With `plan` (made by `paged_decode_plan` for this batch shape with the same window_left,
/// num_splits and variant) the kernels only launch: no host sync, errors go to the plan's flag
/// (`paged_decode_plan_errors`).
#[pyfunction]
#[pyo3(signature = (q, key_cache, value_cache, block_table, seq_lens, o, lse=None, scale=None, softcap=0.0, window_left=-1, num_splits=None, device=-1, stream=0, variant=None, plan=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode(
    py: Python<'_>,
    q: Desc,
    key_cache: Desc,
    value_cache: Desc,
    block_table: Desc,
    seq_lens: Desc,
    o: Desc,
    lse: Option<Desc>,
    scale: Option<f32>,
    softcap: f32,
    window_left: i64,
    num_splits: Option<usize>,
    device: i64,
    stream: u64,
    variant: Option<String>,
    plan: Option<Desc>,
) -> PyResult<()> {
    const OP: &str = "ferrite.paged_decode";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let q = wrap(OP, "q", &q, &tgt)?;
        let kc = wrap(OP, "key_cache", &key_cache, &tgt)?;
        let vc = wrap(OP, "value_cache", &value_cache, &tgt)?;
        let table = wrap(OP, "block_table", &block_table, &tgt)?;
        let lens = wrap(OP, "seq_lens", &seq_lens, &tgt)?;
        let o = wrap(OP, "o", &o, &tgt)?;
        let lse = wrap_opt(OP, "lse", &lse, &tgt)?;
        let plan = wrap_opt(OP, "plan", &plan, &tgt)?;
        let opts = DecodeOptions {
            variant,
            stream: tgt.stream(),
            scale,
            softcap,
            window_left,
            num_splits,
        };
        let kv = PagedKv {
            key_cache: &kc.t,
            value_cache: &vc.t,
            block_table: &table.t,
            seq_lens: &lens.t,
        };
        let lse_t = lse.as_ref().map(|l| &l.t);
        match &plan {
            Some(p) => fdecode::decode_planned_into(&q.t, &kv, &o.t, lse_t, &p.t, &opts)?,
            None => fdecode::decode_into(&q.t, &kv, &o.t, lse_t, &opts)?,
        }
        o.write_back()?;
        if let Some(l) = &lse {
            l.write_back()?;
        }
        // The run writes the plan's partials and error flag.
        if let Some(p) = &plan {
            p.write_back()?;
        }
        Ok(())
    })
}

/// The device of a binding's `device` argument (−1: the CPU).
fn device_of(device: i64) -> Device {
    if device < 0 {
        Device::Cpu
    } else {
        Device::Cuda(device as usize)
    }
}

/// The options a decode plan is made with (and must be run with): window, splits, variant.
fn plan_options(
    tgt: &Target,
    window_left: i64,
    num_splits: Option<usize>,
    variant: Option<String>,
) -> DecodeOptions {
    DecodeOptions {
        variant,
        stream: tgt.stream(),
        window_left,
        num_splits,
        ..Default::default()
    }
}

/// The batch shape a plan is made for, from the bindings' arguments.
fn plan_shape(
    op: &str,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: &str,
    device: i64,
) -> ferrite::Result<PlanShape> {
    Ok(PlanShape {
        batch,
        heads_q,
        heads_kv,
        head_dim,
        dtype: parse_dtype(op, "dtype", dtype)?,
        device: device_of(device),
    })
}

/// Elements of the i32 plan tensor of a decode batch of this shape (`dtype`: q's and the caches'
/// name, e.g. "bfloat16") with these options.
#[pyfunction]
#[pyo3(signature = (batch, heads_q, heads_kv, head_dim, dtype, window_left=-1, num_splits=None, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_plan_numel(
    py: Python<'_>,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: String,
    window_left: i64,
    num_splits: Option<usize>,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<usize> {
    const OP: &str = "ferrite.paged_decode_plan";
    run_value(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let shape = plan_shape(OP, batch, heads_q, heads_kv, head_dim, &dtype, device)?;
        let opts = plan_options(&tgt, window_left, num_splits, variant);
        fdecode::plan_numel(&shape, &opts)
    })
}

/// Plans the decode of the batch whose lengths are `seq_lens` (i32 [B]) into `plan` (i32
/// [`paged_decode_plan_numel`]) on the stream: no host sync. B is seq_lens' length.
#[pyfunction]
#[pyo3(signature = (seq_lens, plan, heads_q, heads_kv, head_dim, dtype, window_left=-1, num_splits=None, device=-1, stream=0, variant=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_plan(
    py: Python<'_>,
    seq_lens: Desc,
    plan: Desc,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    dtype: String,
    window_left: i64,
    num_splits: Option<usize>,
    device: i64,
    stream: u64,
    variant: Option<String>,
) -> PyResult<()> {
    const OP: &str = "ferrite.paged_decode_plan";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let lens = wrap(OP, "seq_lens", &seq_lens, &tgt)?;
        let plan = wrap(OP, "plan", &plan, &tgt)?;
        let batch = lens.t.shape().first().copied().unwrap_or(0);
        let shape = plan_shape(OP, batch, heads_q, heads_kv, head_dim, &dtype, device)?;
        let opts = plan_options(&tgt, window_left, num_splits, variant);
        fdecode::plan_into(&lens.t, &plan.t, &shape, &opts)?;
        plan.write_back()
    })
}

/// Waits for the stream and raises the errors the runs on `plan` flagged since it was planned
/// (a bad seq_len or block-table entry), clearing the flag.
#[pyfunction]
#[pyo3(signature = (plan, device=-1, stream=0))]
pub fn paged_decode_plan_errors(
    py: Python<'_>,
    plan: Desc,
    device: i64,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "ferrite.paged_decode_errors";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let plan = wrap(OP, "plan", &plan, &tgt)?;
        let opts = DecodeOptions {
            stream: tgt.stream(),
            ..Default::default()
        };
        fdecode::plan_errors(&plan.t, &opts)?;
        plan.write_back()
    })
}

/// Writes k, v [T, Hkv, D] into the paged caches at slot_mapping (i32 [T], −1 skips a token).
#[pyfunction]
#[pyo3(signature = (k, v, key_cache, value_cache, slot_mapping, device=-1, stream=0))]
#[allow(clippy::too_many_arguments)]
pub fn append_kv(
    py: Python<'_>,
    k: Desc,
    v: Desc,
    key_cache: Desc,
    value_cache: Desc,
    slot_mapping: Desc,
    device: i64,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "ferrite.append_kv";
    run(py, OP, move || {
        let tgt = target(OP, device, stream)?;
        let k = wrap(OP, "k", &k, &tgt)?;
        let v = wrap(OP, "v", &v, &tgt)?;
        let kc = wrap(OP, "key_cache", &key_cache, &tgt)?;
        let vc = wrap(OP, "value_cache", &value_cache, &tgt)?;
        let slots = wrap(OP, "slot_mapping", &slot_mapping, &tgt)?;
        let opts = AppendOptions {
            stream: tgt.stream(),
        };
        fdecode::append_kv(&k.t, &v.t, &kc.t, &vc.t, &slots.t, &opts)?;
        kc.write_back()?;
        vc.write_back()
    })
}
