//! `ferrite check activation`: every variant against an f64 reference (outputs poisoned first,
//! odd shapes, every activation, with and without bias, dropout p ∈ {0, 0.1, 0.5}, every gradient:
//! dx, db, d(gate), d(up)); the dropout mask bit for bit against `core::philox` on every device
//! (so CPU and GPU agree); and the kept fraction over ~1M elements within 5σ of 1 − p.

use super::{
    bias_act_dropout_backward_into, bias_act_dropout_into, fused_unfit, glu_backward_into,
    glu_into, variants, ActOptions, Activation, Dropout, GluOptions, Problem, OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::philox;
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

/// (act(h), act'(h)) in f64: the reference (the shared formulas of [`Activation`]).
pub fn act_ref(act: Activation, h: f64) -> (f64, f64) {
    (act.apply_f64(h), act.grad_f64(h))
}

/// (rows, cols, act, with bias, p) for bias+act+dropout.
pub fn act_cases(quick: bool) -> Vec<(usize, usize, Activation, bool, f32)> {
    use Activation::*;
    let mut v = vec![
        (1, 1, Relu, true, 0.0),
        (3, 7, GeluTanh, true, 0.5),
        (17, 24, Silu, false, 0.1),
        (64, 768, GeluTanh, true, 0.1),
        (33, 4097, GeluErf, true, 0.0),
        (5, 4096, None, false, 0.5),
        (127, 1000, Relu, true, 0.1),
    ];
    if !quick {
        v.extend([
            (1000, 127, GeluErf, false, 0.5),
            (4, 16384, Silu, true, 0.5),
            (2048, 1024, GeluTanh, true, 0.1),
            (301, 2048, Relu, false, 0.0),
            (3, 65536, None, true, 0.1),
        ]);
    }
    v
}

/// (rows, n, act) for the GLU (input [rows, 2n]).
pub fn glu_cases(quick: bool) -> Vec<(usize, usize, Activation)> {
    use Activation::*;
    let mut v = vec![
        (1, 1, Silu),
        (7, 3, GeluTanh),
        (33, 1000, Silu),
        (64, 768, GeluTanh),
        (5, 4096, GeluErf),
    ];
    if !quick {
        v.extend([
            (127, 4097, Silu),
            (2048, 1024, Silu),
            (300, 2048, GeluTanh),
            (3, 16384, Relu),
        ]);
    }
    v
}

struct ActRef {
    y: Vec<f64>,
    dx: Vec<f64>,
    db: Vec<f64>,
}

fn act_reference(
    x: &[f64],
    b: Option<&[f64]>,
    dy: &[f64],
    cols: usize,
    act: Activation,
    d: &Dropout,
) -> ActRef {
    let (mut y, mut dx, mut db) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; cols]);
    let params = d.params();
    for i in 0..x.len() {
        let c = i % cols;
        let h = x[i] + b.map_or(0.0, |b| b[c]);
        let (a, da) = act_ref(act, h);
        let m = match params {
            None => 1.0,
            Some((thr, scale)) => {
                if philox::keep(d.seed, d.offset, i as u64, thr) {
                    scale as f64
                } else {
                    0.0
                }
            }
        };
        y[i] = a * m;
        dx[i] = dy[i] * m * da;
        db[c] += dx[i];
    }
    ActRef { y, dx, db }
}

fn check_act(
    dev: Device,
    dtype: DType,
    variant: &str,
    (rows, cols, act, with_bias, p): (usize, usize, Activation, bool, f32),
    seed: u64,
) -> Result<(f64, &'static str)> {
    let mut rng = Rng::new(seed);
    let x = Tensor::rand(&[rows, cols], dtype, dev, rng.next_u64(), -3.0, 3.0)?;
    let dy = Tensor::rand(&[rows, cols], dtype, dev, rng.next_u64(), -1.0, 1.0)?;
    let b = if with_bias {
        Some(Tensor::rand(
            &[cols],
            dtype,
            dev,
            rng.next_u64(),
            -1.0,
            1.0,
        )?)
    } else {
        None
    };
    let y = Tensor::empty(&[rows, cols], dtype, dev)?;
    let dx = Tensor::empty(&[rows, cols], dtype, dev)?;
    let db = Tensor::empty(&[cols], dtype, dev)?;
    for t in [&y, &dx, &db] {
        t.poison(None)?;
    }
    let opts = ActOptions {
        variant: Some(variant.into()),
        stream: None,
        act,
        dropout: Dropout {
            p,
            seed: rng.next_u64(),
            // Near a 2³² boundary of the counter now and then: the carry into word 1 matters.
            offset: if rng.below(2) == 0 {
                rng.below(1 << 40)
            } else {
                (1u64 << 32) - rng.below(64)
            },
        },
    };
    bias_act_dropout_into(&x, b.as_ref(), &y, &opts)?;
    bias_act_dropout_backward_into(&dy, &x, b.as_ref(), &dx, b.as_ref().map(|_| &db), &opts)?;
    let bv = b.as_ref().map(|b| b.to_f64_vec()).transpose()?;
    let r = act_reference(
        &x.to_f64_vec()?,
        bv.as_deref(),
        &dy.to_f64_vec()?,
        cols,
        act,
        &opts.dropout,
    );
    let mut worst = (rel_error(&y.to_f64_vec()?, &r.y), "y");
    let mut consider = |e: f64, what: &'static str| {
        if e > worst.0 || e.is_nan() {
            worst = (e, what);
        }
    };
    consider(rel_error(&dx.to_f64_vec()?, &r.dx), "dx");
    if b.is_some() {
        consider(rel_error(&db.to_f64_vec()?, &r.db), "db");
    }
    Ok(worst)
}

fn check_glu(
    dev: Device,
    dtype: DType,
    variant: &str,
    (rows, n, act): (usize, usize, Activation),
    seed: u64,
) -> Result<(f64, &'static str)> {
    let mut rng = Rng::new(seed);
    let inp = Tensor::rand(&[rows, 2 * n], dtype, dev, rng.next_u64(), -3.0, 3.0)?;
    let dout = Tensor::rand(&[rows, n], dtype, dev, rng.next_u64(), -1.0, 1.0)?;
    let out = Tensor::empty(&[rows, n], dtype, dev)?;
    let din = Tensor::empty(&[rows, 2 * n], dtype, dev)?;
    out.poison(None)?;
    din.poison(None)?;
    let opts = GluOptions {
        variant: Some(variant.into()),
        stream: None,
        act,
    };
    glu_into(&inp, &out, &opts)?;
    glu_backward_into(&dout, &inp, &din, &opts)?;
    let (iv, gv) = (inp.to_f64_vec()?, dout.to_f64_vec()?);
    let (mut ro, mut rdg, mut rdu) = (
        vec![0.0; rows * n],
        vec![0.0; rows * n],
        vec![0.0; rows * n],
    );
    for r in 0..rows {
        for j in 0..n {
            let (gate, up) = (iv[r * 2 * n + j], iv[r * 2 * n + n + j]);
            let (a, da) = act_ref(act, gate);
            let g = gv[r * n + j];
            ro[r * n + j] = a * up;
            rdg[r * n + j] = g * up * da;
            rdu[r * n + j] = g * a;
        }
    }
    let dv = din.to_f64_vec()?;
    let (mut dg, mut du) = (Vec::with_capacity(rows * n), Vec::with_capacity(rows * n));
    for r in 0..rows {
        dg.extend_from_slice(&dv[r * 2 * n..][..n]);
        du.extend_from_slice(&dv[r * 2 * n + n..][..n]);
    }
    let mut worst = (rel_error(&out.to_f64_vec()?, &ro), "out");
    for (e, what) in [
        (rel_error(&dg, &rdg), "d(gate)"),
        (rel_error(&du, &rdu), "d(up)"),
    ] {
        if e > worst.0 || e.is_nan() {
            worst = (e, what);
        }
    }
    Ok(worst)
}

/// Dropout alone (act none, no bias, p = 0.5: kept values are exactly 2x in every dtype): the
/// forward's kept/dropped pattern and values, and the backward's, against `philox::keep` element
/// by element. Returns (mismatched elements, kept fraction of the forward).
pub fn mask_identity(
    dev: Device,
    dtype: DType,
    variant: &str,
    (rows, cols): (usize, usize),
    seed: u64,
    p: f32,
) -> Result<(usize, f64)> {
    let mut rng = Rng::new(seed);
    let x = Tensor::rand(&[rows, cols], dtype, dev, rng.next_u64(), 0.5, 1.5)?;
    let y = Tensor::empty(&[rows, cols], dtype, dev)?;
    let dx = Tensor::empty(&[rows, cols], dtype, dev)?;
    y.poison(None)?;
    dx.poison(None)?;
    let d = Dropout {
        p,
        seed: rng.next_u64(),
        offset: (1u64 << 32) - 1000 + rng.below(2000),
    };
    let opts = ActOptions {
        variant: Some(variant.into()),
        stream: None,
        act: Activation::None,
        dropout: d,
    };
    bias_act_dropout_into(&x, None, &y, &opts)?;
    // dy = x: the backward's kept values are x·scale as well.
    bias_act_dropout_backward_into(&x, &x, None, &dx, None, &opts)?;
    let (thr, scale) = d.params().expect("p > 0");
    let xv = x.to_f64_vec()?;
    let (yv, dxv) = (y.to_f64_vec()?, dx.to_f64_vec()?);
    let mut bad = 0;
    let mut kept = 0usize;
    for i in 0..xv.len() {
        let keep = philox::keep(d.seed, d.offset, i as u64, thr);
        kept += keep as usize;
        // The kept value as the kernels round it: x·scale in f32, then to the dtype.
        let want = if keep {
            round_to(dtype, (xv[i] as f32 * scale) as f64)
        } else {
            0.0
        };
        bad += (yv[i] != want) as usize + (dxv[i] != want) as usize;
    }
    Ok((bad, kept as f64 / xv.len() as f64))
}

fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F16 => half::f16::from_f64(v).to_f64(),
        _ => v as f32 as f64,
    }
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                let fits = |cols: usize, glu: bool| {
                    let p = Problem {
                        rows: 1,
                        cols,
                        dtype,
                        device: dev,
                        act: Activation::None,
                        glu,
                    };
                    !(v.name == "fused" && fused_unfit(&p, &[]).is_some())
                };
                for case in act_cases(cfg.quick) {
                    if !fits(case.1, false) {
                        continue;
                    }
                    let label = format!(
                        "{}{} p={} {}×{}",
                        if case.3 { "bias+" } else { "" },
                        case.2.name(),
                        case.4,
                        case.0,
                        case.1
                    );
                    out.push(record(
                        dev,
                        dtype,
                        v.name,
                        label,
                        check_act(dev, dtype, v.name, case, rng.next_u64()),
                    ));
                }
                for case in glu_cases(cfg.quick) {
                    if !fits(case.1, true) {
                        continue;
                    }
                    let label = format!("glu {} {}×2·{}", case.2.name(), case.0, case.1);
                    out.push(record(
                        dev,
                        dtype,
                        v.name,
                        label,
                        check_glu(dev, dtype, v.name, case, rng.next_u64()),
                    ));
                }
                // The mask, bit for bit, and its statistics.
                let shape = if cfg.quick { (256, 1024) } else { (1024, 1032) };
                for p in [0.1f32, 0.5] {
                    let label = format!("dropout mask p={p} {}×{}", shape.0, shape.1);
                    match mask_identity(dev, dtype, v.name, shape, rng.next_u64(), p) {
                        Ok((bad, kept)) => {
                            let mut r = CheckRecord::compared(
                                OP,
                                v.name,
                                dev,
                                dtype,
                                Precision::Exact,
                                label.clone(),
                                bad as f64,
                                "error = elements whose y or dx differs from core::philox's mask"
                                    .into(),
                            );
                            out.push(r.clone());
                            let n = (shape.0 * shape.1) as f64;
                            let q = 1.0 - p as f64;
                            let sigma = (q * (1.0 - q) / n).sqrt();
                            r.shape =
                                format!("dropout kept fraction p={p} {}×{}", shape.0, shape.1);
                            r.precision = Precision::of(dtype);
                            r.error = (kept - q).abs() / sigma;
                            r.tolerance = 5.0;
                            r.pass = r.error <= r.tolerance;
                            r.note = format!("error = |kept − (1−p)|/σ; kept {kept:.5}");
                            out.push(r);
                        }
                        Err(e) => out.push(CheckRecord::errored(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            label,
                            e.to_string(),
                        )),
                    }
                }
            }
        }
    }
    Ok(())
}

fn record(
    dev: Device,
    dtype: DType,
    variant: &str,
    label: String,
    r: Result<(f64, &'static str)>,
) -> CheckRecord {
    match r {
        Ok((e, worst)) => CheckRecord::compared(
            OP,
            variant,
            dev,
            dtype,
            Precision::of(dtype),
            label,
            e,
            format!("worst: {worst}"),
        ),
        Err(e) => CheckRecord::errored(OP, variant, dev, dtype, label, e.to_string()),
    }
}
