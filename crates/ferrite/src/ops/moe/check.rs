//! `ferrite check moe`: every variant's forward and backward against an f64 reference written
//! per token (no permutation: for each token, its chosen experts' MLPs directly), from the
//! variant's own router logits (checked separately against x·routerᵀ), so the routing compared
//! is exact: the chosen experts must match the reference's, the counts and dropped pairs too.
//! Compared: out, the auxiliary and z-losses, dx, d_router, dw_up, dw_down. Cases: E = 1, T = 1,
//! top-1, every token to one expert, experts with no token, T not a multiple of any tile, odd H
//! and I, sigmoid scores with group-limited routing and a routed scale, a capacity factor that
//! drops pairs, and both losses' gradients. CUDA variants are also run twice: the outputs and
//! gradients must repeat bit for bit (no atomics in any sum). `grouped_mm` is checked on its
//! own with empty groups, transposed B and rows not a multiple of the tile.

use super::{
    grouped_mm, moe_backward, moe_forward, variants, Activation, MoeConfig, MoeForward, MoeGrads,
    MoeOptions, MoeWeights, Score,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::{rel_error, rel_error_scaled};
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use crate::ops::activation::check::act_ref;

/// One layer case.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: &'static str,
    pub tokens: usize,
    pub hidden: usize,
    pub inter: usize,
    pub cfg: MoeConfig,
    /// Route every token to expert 0 first (router rows: +1 for expert 0, −1 for the others,
    /// positive inputs).
    pub one_expert: bool,
    pub gpu_only: bool,
}

fn case(name: &'static str, t: usize, h: usize, i: usize, e: usize, k: usize) -> Case {
    Case {
        name,
        tokens: t,
        hidden: h,
        inter: i,
        cfg: MoeConfig::new(e, k),
        one_expert: false,
        gpu_only: false,
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = vec![
        case("E=1,T=1", 1, 16, 8, 1, 1),
        case("top-2", 37, 24, 16, 4, 2),
        Case {
            cfg: MoeConfig {
                act: Activation::GeluTanh,
                aux_loss_coef: 0.1,
                z_loss_coef: 0.01,
                ..MoeConfig::new(8, 1)
            },
            ..case("top-1 geglu aux+z", 100, 32, 24, 8, 1)
        },
        Case {
            one_expert: true,
            ..case("all to expert 0", 45, 16, 8, 6, 2)
        },
        // Top-1 without renormalisation (with it, every weight is 1 and the router's gradient
        // through the weights is exactly 0).
        Case {
            cfg: MoeConfig {
                renormalize: false,
                ..MoeConfig::new(16, 1)
            },
            ..case("empty experts", 5, 16, 16, 16, 1)
        },
        Case {
            cfg: MoeConfig {
                score: Score::Sigmoid,
                renormalize: false,
                groups: 4,
                topk_groups: 2,
                routed_scale: 2.5,
                aux_loss_coef: 0.05,
                ..MoeConfig::new(16, 4)
            },
            ..case("sigmoid groups", 50, 24, 16, 16, 4)
        },
        Case {
            cfg: MoeConfig {
                capacity_factor: Some(0.5),
                ..MoeConfig::new(4, 2)
            },
            one_expert: false,
            ..case("capacity 0.5", 64, 16, 8, 4, 2)
        },
        case("odd H, I", 29, 13, 7, 3, 2),
    ];
    if !quick {
        v.push(case("T=300", 300, 64, 40, 8, 2));
        v.push(Case {
            gpu_only: true,
            cfg: MoeConfig {
                aux_loss_coef: 0.01,
                z_loss_coef: 0.001,
                ..MoeConfig::new(32, 8)
            },
            ..case("fine-grained", 1000, 256, 136, 32, 8)
        });
        v.push(Case {
            gpu_only: true,
            ..case("wide", 517, 512, 384, 8, 2)
        });
    }
    v
}

/// The f64 reference of a case, from the variant's logits.
pub struct Reference {
    pub idx: Vec<usize>,
    pub counts: Vec<usize>,
    pub dropped: usize,
    pub out: Vec<f64>,
    pub aux: f64,
    pub z: f64,
    pub dx: Vec<f64>,
    pub d_router: Vec<f64>,
    pub dw_up: Vec<f64>,
    pub dw_down: Vec<f64>,
}

/// (indices best first, weights, scores, lse) of one token in f64.
fn route_f64(logits: &[f64], cfg: &MoeConfig) -> (Vec<usize>, Vec<f64>, Vec<f64>, f64) {
    let e = logits.len();
    let mx = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let lse = mx + logits.iter().map(|&x| (x - mx).exp()).sum::<f64>().ln();
    let sc: Vec<f64> = logits
        .iter()
        .map(|&x| match cfg.score {
            Score::Softmax => (x - lse).exp(),
            Score::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        })
        .collect();
    let rank = |keys: &[f64], eligible: &dyn Fn(usize) -> bool, k: usize| {
        let mut o: Vec<usize> = (0..keys.len()).filter(|&i| eligible(i)).collect();
        o.sort_by(|&a, &b| keys[b].partial_cmp(&keys[a]).unwrap().then(a.cmp(&b)));
        o.truncate(k);
        o
    };
    let gs = e / cfg.groups;
    let kept_groups: Vec<usize> = if cfg.topk_groups < cfg.groups {
        let gscore: Vec<f64> = (0..cfg.groups)
            .map(|g| {
                let mut v = sc[g * gs..(g + 1) * gs].to_vec();
                v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                if gs > 1 {
                    v[0] + v[1]
                } else {
                    v[0]
                }
            })
            .collect();
        rank(&gscore, &|_| true, cfg.topk_groups)
    } else {
        (0..cfg.groups).collect()
    };
    let idx = rank(logits, &|i| kept_groups.contains(&(i / gs)), cfg.top_k);
    let s: f64 = idx.iter().map(|&i| sc[i]).sum();
    let w = idx
        .iter()
        .map(|&i| {
            let v = if cfg.renormalize { sc[i] / s } else { sc[i] };
            v * cfg.routed_scale as f64
        })
        .collect();
    (idx, w, sc, lse)
}

#[allow(clippy::too_many_arguments)]
pub fn reference(
    c: &Case,
    x: &[f64],
    router: &[f64],
    wu: &[f64],
    wd: &[f64],
    logits: &[f64],
    dout: &[f64],
) -> Reference {
    let (t, h, i, cfg) = (c.tokens, c.hidden, c.inter, &c.cfg);
    let (e, k) = (cfg.experts, cfg.top_k);
    let routes: Vec<_> = (0..t)
        .map(|tok| route_f64(&logits[tok * e..(tok + 1) * e], cfg))
        .collect();
    let mut counts = vec![0usize; e];
    let mut kept = vec![false; t * k];
    let cap = cfg.capacity(t);
    for (tok, r) in routes.iter().enumerate() {
        for (j, &ex) in r.0.iter().enumerate() {
            kept[tok * k + j] = cap.is_none_or(|c| counts[ex] < c);
            counts[ex] += 1;
        }
    }
    let dropped = kept.iter().filter(|&&b| !b).count();
    let (mut out, mut dx) = (vec![0f64; t * h], vec![0f64; t * h]);
    let (mut dw_up, mut dw_down) = (vec![0f64; e * h * 2 * i], vec![0f64; e * i * h]);
    let mut d_router = vec![0f64; e * h];
    let mut dw = vec![0f64; t * k];
    for (tok, r) in routes.iter().enumerate() {
        let xt = &x[tok * h..(tok + 1) * h];
        let g = &dout[tok * h..(tok + 1) * h];
        for (j, &ex) in r.0.iter().enumerate() {
            if !kept[tok * k + j] {
                continue;
            }
            let wu_e = &wu[ex * h * 2 * i..(ex + 1) * h * 2 * i];
            let wd_e = &wd[ex * i * h..(ex + 1) * i * h];
            let u: Vec<f64> = (0..2 * i)
                .map(|c| (0..h).map(|q| xt[q] * wu_e[q * 2 * i + c]).sum())
                .collect();
            let a: Vec<(f64, f64)> = (0..i).map(|c| act_ref(cfg.act, u[c])).collect();
            let hv: Vec<f64> = (0..i).map(|c| a[c].0 * u[i + c]).collect();
            let y: Vec<f64> = (0..h)
                .map(|q| (0..i).map(|c| hv[c] * wd_e[c * h + q]).sum())
                .collect();
            let wt = r.1[j];
            for q in 0..h {
                out[tok * h + q] += wt * y[q];
            }
            // Backward of this pair.
            dw[tok * k + j] = (0..h).map(|q| g[q] * y[q]).sum();
            let dy: Vec<f64> = g.iter().map(|v| wt * v).collect();
            let dh: Vec<f64> = (0..i)
                .map(|c| (0..h).map(|q| dy[q] * wd_e[c * h + q]).sum())
                .collect();
            for c in 0..i {
                for q in 0..h {
                    dw_down[ex * i * h + c * h + q] += hv[c] * dy[q];
                }
            }
            let du: Vec<f64> = (0..2 * i)
                .map(|c| {
                    if c < i {
                        dh[c] * u[i + c] * a[c].1
                    } else {
                        dh[c - i] * a[c - i].0
                    }
                })
                .collect();
            for q in 0..h {
                dx[tok * h + q] += (0..2 * i).map(|c| du[c] * wu_e[q * 2 * i + c]).sum::<f64>();
                for c in 0..2 * i {
                    dw_up[ex * h * 2 * i + q * 2 * i + c] += xt[q] * du[c];
                }
            }
        }
    }
    // Router: through the weights, the aux loss, the scoring, the z-loss.
    let aux_c = cfg.aux_loss_coef as f64 * e as f64 / (t as f64 * t as f64 * k as f64);
    let mut aux = 0.0;
    let mut pmean = vec![0f64; e];
    for r in &routes {
        for (pm, s) in pmean.iter_mut().zip(&r.2) {
            *pm += s / t as f64;
        }
    }
    for (c, pm) in counts.iter().zip(&pmean) {
        aux += *c as f64 / (t * k) as f64 * pm;
    }
    let aux = cfg.aux_loss_coef as f64 * e as f64 * aux;
    let z = cfg.z_loss_coef as f64 * routes.iter().map(|r| r.3 * r.3).sum::<f64>() / t as f64;
    for (tok, r) in routes.iter().enumerate() {
        let (idx, _, sc, lse) = r;
        let mut ds: Vec<f64> = counts.iter().map(|&c| aux_c * c as f64).collect();
        let s: f64 = idx.iter().map(|&q| sc[q]).sum();
        let gsum: f64 = idx
            .iter()
            .enumerate()
            .map(|(j, &q)| dw[tok * k + j] * sc[q])
            .sum();
        let scale = cfg.routed_scale as f64;
        for (j, &q) in idx.iter().enumerate() {
            let gj = dw[tok * k + j];
            ds[q] += if cfg.renormalize {
                scale * (gj / s - gsum / (s * s))
            } else {
                scale * gj
            };
        }
        let dot: f64 = (0..e).map(|q| sc[q] * ds[q]).sum();
        for q in 0..e {
            let mut d = match cfg.score {
                Score::Softmax => sc[q] * (ds[q] - dot),
                Score::Sigmoid => ds[q] * sc[q] * (1.0 - sc[q]),
            };
            d += 2.0 * cfg.z_loss_coef as f64 * lse / t as f64 * (logits[tok * e + q] - lse).exp();
            for c in 0..h {
                dx[tok * h + c] += d * router[q * h + c];
                d_router[q * h + c] += d * x[tok * h + c];
            }
        }
    }
    Reference {
        idx: routes.iter().flat_map(|r| r.0.iter().copied()).collect(),
        counts,
        dropped,
        out,
        aux,
        z,
        dx,
        d_router,
        dw_up,
        dw_down,
    }
}

/// Inputs of a case on `dev`: x, router, w_up, w_down, dout.
pub fn inputs(c: &Case, dt: DType, dev: Device, seed: u64) -> Result<[Tensor; 5]> {
    let (t, h, i, e) = (c.tokens, c.hidden, c.inter, c.cfg.experts);
    let mut rng = Rng::new(seed);
    let x = if c.one_expert {
        Tensor::rand(&[t, h], dt, dev, rng.next_u64(), 0.1, 1.0)?
    } else {
        Tensor::rand(&[t, h], dt, dev, rng.next_u64(), -1.0, 1.0)?
    };
    let router = if c.one_expert {
        let v: Vec<f32> = (0..e * h)
            .map(|q| {
                if q / h == 0 {
                    0.5
                } else {
                    -0.5 + 0.01 * (q % 7) as f32
                }
            })
            .collect();
        let r = Tensor::empty(&[e, h], dt, Device::Cpu)?;
        r.write_f32(&v)?;
        r.to_device(dev)?
    } else {
        Tensor::rand(&[e, h], dt, dev, rng.next_u64(), -1.0, 1.0)?
    };
    let su = 1.0 / (h as f64).sqrt();
    let sd = 1.0 / (i as f64).sqrt();
    let wu = Tensor::rand(&[e, h, 2 * i], dt, dev, rng.next_u64(), -su, su)?;
    let wd = Tensor::rand(&[e, i, h], dt, dev, rng.next_u64(), -sd, sd)?;
    let dout = Tensor::rand(&[t, h], dt, dev, rng.next_u64(), -1.0, 1.0)?;
    Ok([x, router, wu, wd, dout])
}

/// Worst (error / tolerance, error, what) over the compared tensors of one run.
fn compare(
    c: &Case,
    f: &MoeForward,
    gr: &MoeGrads,
    r: &Reference,
    x: &[f64],
    router: &[f64],
    tol: f64,
) -> Result<(f64, String)> {
    let idx: Vec<usize> = f.idx.to_vec::<i32>()?.iter().map(|&v| v as usize).collect();
    if idx != r.idx {
        return Ok((
            f64::INFINITY,
            "chosen experts differ from the reference's".into(),
        ));
    }
    let m = f.metrics()?;
    if m.tokens_per_expert != r.counts || m.dropped != r.dropped {
        return Ok((
            f64::INFINITY,
            format!(
                "counts {:?} dropped {} (reference {:?}, {})",
                m.tokens_per_expert, m.dropped, r.counts, r.dropped
            ),
        ));
    }
    // The logits themselves against x·routerᵀ.
    let (t, h, e) = (c.tokens, c.hidden, c.cfg.experts);
    let lref: Vec<f64> = (0..t * e)
        .map(|q| {
            (0..h)
                .map(|j| x[(q / e) * h + j] * router[(q % e) * h + j])
                .sum()
        })
        .collect();
    let mut worst = (
        rel_error(&f.logits.to_f64_vec()?, &lref),
        "logits".to_string(),
    );
    let loss = |got: f32, want: f64| {
        let d = (got as f64 - want).abs();
        if !got.is_finite() {
            f64::INFINITY
        } else {
            d / want.abs().max(1e-3)
        }
    };
    // Relative error, with a floor of 1e-6 per element under the reference's norm (a gradient
    // that is exactly 0 in f64 is held to an absolute bound, not a relative one).
    let rel = |got: &Tensor, want: &[f64]| -> Result<f64> {
        let floor = 1e-6 * (want.len() as f64).sqrt();
        Ok(rel_error_scaled(&got.to_f64_vec()?, want, floor))
    };
    for (name, err) in [
        ("out", rel(&f.out, &r.out)?),
        ("aux_loss", loss(m.aux_loss, r.aux)),
        ("z_loss", loss(m.z_loss, r.z)),
        ("dx", rel(&gr.dx, &r.dx)?),
        ("d_router", rel(&gr.d_router, &r.d_router)?),
        ("dw_up", rel(&gr.dw_up, &r.dw_up)?),
        ("dw_down", rel(&gr.dw_down, &r.dw_down)?),
    ] {
        if err.is_nan() || err > worst.0 {
            worst = (err, name.into());
        }
    }
    let _ = tol;
    Ok(worst)
}

/// Bits of every output and gradient of a run (the repeat check).
fn bits(f: &MoeForward, g: &MoeGrads) -> Result<Vec<Vec<u8>>> {
    [&f.out, &g.dx, &g.d_router, &g.dw_up, &g.dw_down]
        .iter()
        .map(|t| t.to_bytes())
        .collect()
}

fn tolerance(dev: Device, dt: DType) -> (Precision, f64) {
    match (dev, dt) {
        (Device::Cpu, DType::F32) => (Precision::F32, 1e-4),
        (_, DType::F32) => (Precision::Tf32, 5e-3),
        (_, DType::F16) => (Precision::F16, 1.5e-2),
        _ => (Precision::Bf16, 4e-2),
    }
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    for &dev in &cfg.devices {
        let backend = Backend::of(dev);
        let arch = crate::core::cuda::arch_of(dev)?;
        for v in variants().into_iter().filter(|v| v.backend == backend) {
            if !cfg.wants_variant(v.name) {
                continue;
            }
            for &dt in v.dtypes {
                if !cfg.wants_dtype(dt) || v.unsupported_reason(backend, dt, arch).is_some() {
                    continue;
                }
                // CPU: f32 and bf16 cover both paths (f16 rounds like bf16 with more bits).
                if dev == Device::Cpu && dt == DType::F16 {
                    continue;
                }
                for (ci, c) in cases(cfg.quick).into_iter().enumerate() {
                    if c.gpu_only && dev == Device::Cpu {
                        continue;
                    }
                    let rec = check_case(&c, v.name, dev, dt, cfg.seed ^ (ci as u64 * 7919))?;
                    out.push(rec);
                }
            }
        }
        if cfg.wants_variant("grouped_mm") || cfg.variants.is_empty() {
            for &dt in &[DType::F32, DType::BF16] {
                if cfg.wants_dtype(dt) {
                    out.extend(check_grouped_mm(dev, dt, cfg.seed)?);
                }
            }
        }
    }
    Ok(())
}

fn check_case(c: &Case, variant: &str, dev: Device, dt: DType, seed: u64) -> Result<CheckRecord> {
    let (prec, tol) = tolerance(dev, dt);
    let mut rec = CheckRecord {
        op: super::OP.into(),
        variant: variant.into(),
        device: dev.to_string(),
        dtype: dt.name().into(),
        precision: prec,
        shape: format!(
            "{} T{} H{} I{} E{} k{}",
            c.name, c.tokens, c.hidden, c.inter, c.cfg.experts, c.cfg.top_k
        ),
        error: f64::INFINITY,
        tolerance: tol,
        pass: false,
        note: String::new(),
    };
    let [x, router, wu, wd, dout] = inputs(c, dt, dev, seed)?;
    let w = MoeWeights {
        router: &router,
        w_up: &wu,
        w_down: &wd,
    };
    let opts = MoeOptions {
        variant: Some(variant.into()),
        stream: None,
        forward_only: false,
    };
    let run = || -> Result<(MoeForward, MoeGrads)> {
        let f = moe_forward(&x, &w, &c.cfg, &opts)?;
        let g = moe_backward(&dout, &x, &w, &f, &c.cfg, &opts)?;
        Ok((f, g))
    };
    let (f, g) = match run() {
        Ok(r) => r,
        Err(crate::core::error::Error::NoVariant { msg, .. }) => {
            rec.note = format!("skipped: {msg}");
            rec.pass = true;
            rec.error = 0.0;
            return Ok(rec);
        }
        Err(e) => return Err(e),
    };
    let (xs, rs) = (x.to_f64_vec()?, router.to_f64_vec()?);
    let r = reference(
        c,
        &xs,
        &rs,
        &wu.to_f64_vec()?,
        &wd.to_f64_vec()?,
        &f.logits.to_f64_vec()?,
        &dout.to_f64_vec()?,
    );
    let (err, what) = compare(c, &f, &g, &r, &xs, &rs, tol)?;
    rec.error = err;
    rec.pass = err <= tol;
    rec.note = format!("worst: {what}");
    if dev.is_cuda() && rec.pass {
        let first = bits(&f, &g)?;
        let (f2, g2) = run()?;
        if bits(&f2, &g2)? != first {
            rec.pass = false;
            rec.note += "; a second run gave different bits";
        } else {
            rec.note += "; repeats bit for bit";
        }
        // A forward-only run (inference: `fused` skips the pre-activations' stores) gives the
        // same output bits, and its state is refused by the backward.
        let inf = MoeOptions {
            forward_only: true,
            ..opts.clone()
        };
        let f3 = moe_forward(&x, &w, &c.cfg, &inf)?;
        if f3.out.to_f64_vec()? != f.out.to_f64_vec()? {
            rec.pass = false;
            rec.note += "; forward_only changed the output";
        } else if moe_backward(&dout, &x, &w, &f3, &c.cfg, &opts).is_ok() {
            rec.pass = false;
            rec.note += "; the backward took a forward_only state";
        }
    }
    Ok(rec)
}

/// grouped_mm against f64: random group sizes with empty groups, B plain and transposed.
fn check_grouped_mm(dev: Device, dt: DType, seed: u64) -> Result<Vec<CheckRecord>> {
    let mut recs = Vec::new();
    let (prec, tol) = match (dev, dt) {
        (Device::Cpu, DType::F32) => (Precision::F32, 1e-5),
        (_, DType::F32) => (Precision::Tf32, 2e-3),
        _ => (Precision::Bf16, 1e-2),
    };
    for (ci, &(m, k, n, g, bt)) in [
        (300usize, 64usize, 72usize, 5usize, false),
        (129, 40, 24, 7, true),
        (1, 16, 8, 3, false),
        (1000, 128, 264, 9, true),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(seed ^ (ci as u64 + 101));
        // Group sizes: random, two of them empty.
        let mut sizes: Vec<usize> = (0..g).map(|_| (rng.next_u64() % 97) as usize).collect();
        sizes[0] = 0;
        sizes[g / 2] = 0;
        let tot: usize = sizes.iter().sum::<usize>().max(1);
        let mut ends = Vec::with_capacity(g);
        let mut run = 0usize;
        for (q, s) in sizes.iter().enumerate() {
            run += s * m / tot;
            ends.push(if q + 1 == g { m } else { run.min(m) } as i32);
        }
        let a = Tensor::rand(&[m, k], dt, dev, rng.next_u64(), -1.0, 1.0)?;
        let b = if bt {
            Tensor::rand(&[g, n, k], dt, dev, rng.next_u64(), -1.0, 1.0)?.transpose(1, 2)?
        } else {
            Tensor::rand(&[g, k, n], dt, dev, rng.next_u64(), -1.0, 1.0)?
        };
        let offs = Tensor::from_vec(ends.clone(), &[g])?.to_device(dev)?;
        let o = Tensor::full(&[m, n], dt, dev, f64::NAN)?;
        let mut rec = CheckRecord {
            op: super::OP.into(),
            variant: "grouped_mm".into(),
            device: dev.to_string(),
            dtype: dt.name().into(),
            precision: prec,
            shape: format!(
                "[{m},{k}]·[{g},{k},{n}]{}",
                if bt { " (b transposed)" } else { "" }
            ),
            error: f64::INFINITY,
            tolerance: tol,
            pass: false,
            note: format!("ends {ends:?}"),
        };
        match grouped_mm(&a, &b, &offs, &o, &MoeOptions::default()) {
            Err(crate::core::error::Error::NoVariant { msg, .. }) => {
                rec.note = format!("skipped: {msg}");
                rec.pass = true;
                rec.error = 0.0;
                recs.push(rec);
                continue;
            }
            r => r?,
        }
        let (av, bv) = (a.to_f64_vec()?, b.to_f64_vec()?);
        let mut want = vec![0f64; m * n];
        let mut s = 0usize;
        for (ex, &en) in ends.iter().enumerate() {
            for r in s..en as usize {
                for j in 0..n {
                    want[r * n + j] = (0..k)
                        .map(|q| av[r * k + q] * bv[ex * k * n + q * n + j])
                        .sum();
                }
            }
            s = en as usize;
        }
        rec.error = rel_error(&o.to_f64_vec()?, &want);
        rec.pass = rec.error <= tol;
        recs.push(rec);
    }
    Ok(recs)
}
