//! `ferrite check cross_entropy`: per-row loss, scalar loss and dlogits of every variant against
//! an f64 reference, outputs poisoned first; odd vocabularies (1, 3, 4099, 50257, 128256), ignored
//! rows, label smoothing, every reduction, i64 and i32 targets, in-place and separate gradients,
//! masked (−inf) logits.
//! Then the bad-target path: an out-of-range target must be an error naming the row and value,
//! and with the check off (GPU) only that row may be NaN.

use super::{cross_entropy_into, variants, CrossEntropyOptions, GradOut, Reduction, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

#[derive(Clone, Copy, Debug)]
pub enum Grad {
    Skip,
    Into,
    InPlace,
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub rows: usize,
    pub vocab: usize,
    pub reduction: Reduction,
    pub smoothing: f32,
    pub grad: Grad,
    pub targets: DType,
    pub ignore_index: i64,
    /// Logits uniform in ±range.
    pub range: f64,
    /// Some logits −inf (masked classes, never the target): a contiguous prefix of the even rows
    /// (whole 16-byte vectors and whole threads' first vectors) and ~40 % scattered elsewhere.
    pub masked: bool,
    /// Columns past V in each row of the logits (and dlogits) buffer: the op sees a [N, V] view
    /// with row stride V + pad (a vocabulary padded for the GEMMs); the pad must stay untouched.
    pub pad: usize,
}

pub fn cases(quick: bool) -> Vec<Case> {
    use Grad::*;
    use Reduction::*;
    let c = |rows, vocab, reduction, smoothing, grad, targets, ignore_index, range| Case {
        rows,
        vocab,
        reduction,
        smoothing,
        grad,
        targets,
        ignore_index,
        range,
        masked: false,
        pad: 0,
    };
    let mut v = vec![
        c(1, 1, Mean, 0.0, Into, DType::I64, -100, 1.0),
        c(7, 3, Sum, 0.1, InPlace, DType::I32, -100, 4.0),
        c(129, 1000, None, 0.2, Into, DType::I64, -100, 20.0),
        c(3, 50257, Mean, 0.1, InPlace, DType::I64, -100, 8.0),
        c(33, 4099, Mean, 0.0, Into, DType::I32, -100, 8.0),
        c(129, 257, Sum, 0.0, Skip, DType::I64, 5, 8.0),
        Case {
            masked: true,
            ..c(37, 3001, Mean, 0.0, Into, DType::I64, -100, 8.0)
        },
        Case {
            pad: 47,
            ..c(65, 50257, Mean, 0.0, InPlace, DType::I32, -100, 8.0)
        },
        Case {
            pad: 13,
            ..c(9, 1001, Sum, 0.1, Into, DType::I64, -100, 8.0)
        },
    ];
    if !quick {
        v.extend([
            c(129, 50257, Mean, 0.1, InPlace, DType::I64, -100, 8.0),
            c(2, 128256, Sum, 0.0, Into, DType::I32, -100, 8.0),
            c(7, 3, None, 0.5, Into, DType::I32, -100, 30.0),
            c(1000, 127, Mean, 0.0, InPlace, DType::I64, -100, 8.0),
            c(64, 32000, Mean, 0.05, Into, DType::I64, -100, 4.0),
        ]);
    }
    v
}

/// Random targets in [0, V), about a fifth of the rows (never row 0) set to ignore_index.
fn make_targets(c: &Case, seed: u64) -> Vec<i64> {
    let mut rng = Rng::new(seed);
    (0..c.rows)
        .map(|r| {
            let t = (rng.next_u64() % c.vocab as u64) as i64;
            if r > 0 && c.rows >= 3 && rng.next_u64().is_multiple_of(5) {
                c.ignore_index
            } else if t == c.ignore_index {
                // An in-range ignore_index would otherwise ignore rows by chance.
                (t + 1) % c.vocab as i64
            } else {
                t
            }
        })
        .collect()
}

pub fn target_tensor(t: &[i64], dtype: DType, dev: Device) -> Result<Tensor> {
    let cpu = match dtype {
        DType::I32 => Tensor::from_vec(t.iter().map(|&x| x as i32).collect(), &[t.len()])?,
        _ => Tensor::from_vec(t.to_vec(), &[t.len()])?,
    };
    cpu.to_device(dev)
}

/// (per-row loss, scalar, dlogits) in f64.
pub fn reference(
    x: &[f64],
    t: &[i64],
    vocab: usize,
    ignore: i64,
    eps: f64,
    reduction: Reduction,
    dloss: f64,
) -> (Vec<f64>, f64, Vec<f64>) {
    let n = t.len();
    let count = t.iter().filter(|&&a| a != ignore).count() as f64;
    let scale = if reduction == Reduction::Mean {
        dloss / count
    } else {
        dloss
    };
    let (mut lr, mut g) = (vec![0.0; n], vec![0.0; n * vocab]);
    for r in 0..n {
        if t[r] == ignore {
            continue;
        }
        let row = &x[r * vocab..][..vocab];
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &a| m.max(a));
        let lse = m + row.iter().map(|&a| (a - m).exp()).sum::<f64>().ln();
        let tt = t[r] as usize;
        // Σ_j q_j·(−log p_j) with q = (1−ε)·one-hot + ε/V.
        lr[r] = (0..vocab)
            .map(|j| {
                let q = eps / vocab as f64 + if j == tt { 1.0 - eps } else { 0.0 };
                // A class with no weight adds nothing, even a masked (−inf) one.
                if q == 0.0 {
                    0.0
                } else {
                    q * (lse - row[j])
                }
            })
            .sum();
        for j in 0..vocab {
            let q = eps / vocab as f64 + if j == tt { 1.0 - eps } else { 0.0 };
            g[r * vocab + j] = scale * ((row[j] - lse).exp() - q);
        }
    }
    let s: f64 = lr.iter().sum();
    let scalar = if reduction == Reduction::Mean {
        s / count
    } else {
        s
    };
    (lr, scalar, g)
}

fn check_one(
    dev: Device,
    dtype: DType,
    variant: &str,
    cluster: Option<usize>,
    c: &Case,
    seed: u64,
) -> Result<(f64, String)> {
    let (n, v) = (c.rows, c.vocab);
    let t = make_targets(c, seed ^ 0x55);
    let logits = Tensor::rand(&[n, v], dtype, Device::Cpu, seed, -c.range, c.range)?;
    if c.masked {
        let mut x = logits.to_f32_vec()?;
        for (r, row) in x.chunks_mut(v).enumerate() {
            for (j, e) in row.iter_mut().enumerate() {
                let prefix = r % 2 == 0 && j < v / 3;
                if j as i64 != t[r] && (prefix || (j * 7 + r * 3) % 5 < 2) {
                    *e = f32::NEG_INFINITY;
                }
            }
        }
        logits.write_f32(&x)?;
    }
    let ld = v + c.pad;
    // The buffers are [n, ld]; the op sees their [n, v] views. Pad columns hold a sentinel.
    const SENTINEL: f64 = 1024.0; // exact in every float dtype
    let padded = |t: &Tensor| -> Result<Tensor> {
        let x = t.to_f32_vec()?;
        let mut buf = vec![SENTINEL as f32; n * ld];
        for r in 0..n {
            buf[r * ld..r * ld + v].copy_from_slice(&x[r * v..(r + 1) * v]);
        }
        let b = Tensor::from_vec(buf, &[n, ld])?.to_device(Device::Cpu)?;
        let b = if dtype == DType::F32 {
            b
        } else {
            let o = Tensor::empty(&[n, ld], dtype, Device::Cpu)?;
            o.write_f32(&b.to_f32_vec()?)?;
            o
        };
        b.to_device(dev)
    };
    let logits_buf = padded(&logits)?;
    let logits = logits_buf.narrow(1, 0, v)?;
    let targets = target_tensor(&t, c.targets, dev)?;
    let x = logits.to_f64_vec()?;
    let loss_rows = Tensor::empty(&[n], DType::F32, dev)?;
    let loss = Tensor::empty(&[1], DType::F32, dev)?;
    let g_buf = padded(&Tensor::full(&[n, v], DType::F32, Device::Cpu, f64::NAN)?)?;
    let g = g_buf.narrow(1, 0, v)?;
    for o in [&loss_rows, &loss] {
        o.poison(None)?;
    }
    if c.pad == 0 {
        g.poison(None)?;
    }
    let dloss = 0.5 + (seed % 1000) as f32 / 1000.0;
    let opts = CrossEntropyOptions {
        variant: Some(variant.into()),
        ignore_index: c.ignore_index,
        label_smoothing: c.smoothing,
        reduction: c.reduction,
        dloss,
        cluster,
        ..Default::default()
    };
    let grad = match c.grad {
        Grad::Skip => GradOut::Skip,
        Grad::Into => GradOut::Into(&g),
        Grad::InPlace => GradOut::InPlace,
    };
    cross_entropy_into(&logits, &targets, &loss_rows, Some(&loss), grad, &opts)?;
    let (rl, rs, rg) = reference(
        &x,
        &t,
        v,
        c.ignore_index,
        c.smoothing as f64,
        c.reduction,
        dloss as f64,
    );
    let mut errs = vec![
        ("loss_rows", rel_error(&loss_rows.to_f64_vec()?, &rl)),
        ("loss", rel_error(&loss.to_f64_vec()?, &[rs])),
    ];
    match c.grad {
        Grad::Skip => {}
        Grad::Into => errs.push(("dlogits", rel_error(&g.to_f64_vec()?, &rg))),
        Grad::InPlace => errs.push(("dlogits (in place)", rel_error(&logits.to_f64_vec()?, &rg))),
    }
    if c.pad > 0 {
        for (nm, b) in [("logits padding", &logits_buf), ("dlogits padding", &g_buf)] {
            let vals = b.to_f64_vec()?;
            let touched = (0..n).any(|r| {
                vals[r * ld + v..(r + 1) * ld]
                    .iter()
                    .any(|&x| x != SENTINEL)
            });
            errs.push((nm, if touched { f64::INFINITY } else { 0.0 }));
        }
    }
    let (name, e) = errs.iter().fold(("", 0.0f64), |w, &(nm, e)| {
        if e > w.1 || e.is_nan() {
            (nm, e)
        } else {
            w
        }
    });
    Ok((e, format!("worst: {name}")))
}

/// The bad-target path on `dev`: with the check on, an error naming the row and value; on the
/// GPU with the check off, the bad row's loss and gradient NaN and every other row right.
fn check_bad_target(dev: Device, variant: &str, seed: u64) -> Result<(f64, String)> {
    let (n, v) = (9, 1003);
    let logits = Tensor::rand(&[n, v], DType::F32, dev, seed, -4.0, 4.0)?;
    let mut t: Vec<i64> = (0..n as i64).map(|r| (r * 97) % v as i64).collect();
    t[1] = -100;
    t[5] = v as i64 + 7;
    t[7] = -3;
    let targets = target_tensor(&t, DType::I64, dev)?;
    let loss_rows = Tensor::empty(&[n], DType::F32, dev)?;
    let loss = Tensor::empty(&[1], DType::F32, dev)?;
    let g = Tensor::empty(&[n, v], DType::F32, dev)?;
    let mut opts = CrossEntropyOptions {
        variant: Some(variant.into()),
        ..Default::default()
    };
    let r = cross_entropy_into(
        &logits,
        &targets,
        &loss_rows,
        Some(&loss),
        GradOut::Into(&g),
        &opts,
    );
    let want = format!("targets[5] = {}", v + 7);
    match r {
        Ok(()) => return Ok((f64::INFINITY, "bad target accepted".into())),
        Err(e) if !e.to_string().contains(&want) => {
            return Ok((f64::INFINITY, format!("error does not name `{want}`: {e}")))
        }
        Err(_) => {}
    }
    if !dev.is_cuda() {
        return Ok((0.0, format!("error names `{want}`")));
    }
    // Unchecked (graph-capture mode): rows 5 and 7 NaN, the others as the reference with those
    // rows ignored (a sum, so the valid rows' scale does not depend on the count).
    opts.check_targets = false;
    opts.reduction = Reduction::Sum;
    for o in [&loss_rows, &g] {
        o.poison(None)?;
    }
    cross_entropy_into(
        &logits,
        &targets,
        &loss_rows,
        None,
        GradOut::Into(&g),
        &opts,
    )?;
    let mut tr = t.clone();
    tr[5] = -100;
    tr[7] = -100;
    let (rl, _, rg) = reference(
        &logits.to_f64_vec()?,
        &tr,
        v,
        -100,
        0.0,
        Reduction::Sum,
        1.0,
    );
    let (lo, go) = (loss_rows.to_f64_vec()?, g.to_f64_vec()?);
    for bad in [5, 7] {
        if !lo[bad].is_nan() || !go[bad * v..][..v].iter().all(|a| a.is_nan()) {
            return Ok((f64::INFINITY, format!("unchecked: row {bad} not NaN")));
        }
    }
    let good = |a: &[f64], w: usize| -> Vec<f64> {
        (0..n)
            .filter(|r| *r != 5 && *r != 7)
            .flat_map(|r| a[r * w..][..w].to_vec())
            .collect()
    };
    let e = rel_error(&good(&lo, 1), &good(&rl, 1)).max(rel_error(&good(&go, v), &good(&rg, v)));
    Ok((
        e,
        format!("error names `{want}`; unchecked: bad rows NaN, others right"),
    ))
}

/// The cases of `variant` with the cluster size each runs: `cluster` at every size whose share of
/// the row fits this GPU's shared memory (so whichever the rule picks has been checked), the
/// others at None.
fn with_cluster_sizes(
    variant: &str,
    dev: Device,
    dtype: DType,
    cases: Vec<Case>,
) -> Result<Vec<(Case, Option<usize>)>> {
    let Device::Cuda(i) = dev else {
        return Ok(cases.into_iter().map(|c| (c, None)).collect());
    };
    if variant != "cluster" {
        return Ok(cases.into_iter().map(|c| (c, None)).collect());
    }
    let props = crate::core::cuda::device(i)?.props().clone();
    let mut v = Vec::new();
    for c in cases {
        for k in super::cuda::CLUSTERS {
            let full = c.vocab / crate::core::cuda::rows::vec_width(dtype);
            let fits = super::cuda::cluster_shape(
                k,
                props
                    .max_threads_per_sm
                    .min(super::cuda::CLUSTER_SM_THREADS),
                props.smem_per_sm as usize,
                props.smem_per_block_optin as usize,
                full,
            )
            .is_some();
            if fits {
                v.push((c, Some(k)));
            }
        }
    }
    Ok(v)
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                for (c, cluster) in with_cluster_sizes(v.name, dev, dtype, cases(cfg.quick))? {
                    let label = format!(
                        "{}×{} {} ε={} {:?} {} targets{}{}{}",
                        c.rows,
                        c.vocab,
                        c.reduction.name(),
                        c.smoothing,
                        c.grad,
                        c.targets,
                        if c.ignore_index == -100 {
                            String::new()
                        } else {
                            format!(" ignore={}", c.ignore_index)
                        },
                        if c.masked { " masked −inf" } else { "" },
                        cluster.map_or(String::new(), |k| format!(" clusters of {k}"))
                    );
                    out.push(
                        match check_one(dev, dtype, v.name, cluster, &c, rng.next_u64()) {
                            Ok((e, note)) => CheckRecord::compared(
                                OP,
                                v.name,
                                dev,
                                dtype,
                                Precision::of(dtype),
                                label,
                                e,
                                note,
                            ),
                            Err(e) => {
                                CheckRecord::errored(OP, v.name, dev, dtype, label, e.to_string())
                            }
                        },
                    );
                }
            }
            if cfg.wants_dtype(DType::F32) {
                let label = "9×1003 bad targets (rows 5, 7)".to_string();
                out.push(match check_bad_target(dev, v.name, rng.next_u64()) {
                    Ok((e, note)) => CheckRecord::compared(
                        OP,
                        v.name,
                        dev,
                        DType::F32,
                        Precision::F32,
                        label,
                        e,
                        note,
                    ),
                    Err(e) => {
                        CheckRecord::errored(OP, v.name, dev, DType::F32, label, e.to_string())
                    }
                });
            }
        }
    }
    Ok(())
}
