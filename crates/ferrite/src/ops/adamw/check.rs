//! `ferrite check adamw`: several steps over a list of tensors of odd sizes (1, 3, 16385,
//! 1000003 ..., one of them a view at an odd offset so the vector path is refused for it) against
//! torch.optim.AdamW's update in f64; f32 params, and bf16 params with f32 master weights (bf16 or
//! f32 grads). Compared: params (or master), exp_avg, exp_avg_sq; a bf16 param must equal its
//! master rounded to nearest, bit for bit.

use super::{adamw_step, variants, AdamWHyper, AdamWOptions, AdamWTensor, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

#[derive(Clone, Debug)]
pub struct Case {
    pub sizes: Vec<usize>,
    pub steps: u64,
    pub hyper: AdamWHyper,
}

pub fn cases(quick: bool) -> Vec<Case> {
    let h = AdamWHyper {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut v = vec![
        Case {
            sizes: vec![1, 3, 1000, 16385, 70001, 7],
            steps: 3,
            hyper: h,
        },
        Case {
            sizes: vec![4099],
            steps: 2,
            hyper: AdamWHyper {
                lr: 3e-3,
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.0,
                grad_scale: 0.25,
                ..Default::default()
            },
        },
    ];
    if !quick {
        v.push(Case {
            sizes: vec![1000003, 3, 1, 2 * 65536 + 5],
            steps: 3,
            hyper: h,
        });
        v.push(Case {
            sizes: (0..150).map(|i| (i * 37) % 1000 + 1).collect(),
            steps: 2,
            hyper: h,
        });
    }
    v
}

/// One tensor's state on the device and in f64.
struct State {
    param: Tensor,
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    rp: Vec<f64>,
    rm: Vec<f64>,
    rv: Vec<f64>,
    /// The same recurrence as rm on |m| and |g|: the size of the terms summed into exp_avg, which
    /// can cancel (a 1-element tensor whose gradients change sign).
    rm_mag: Vec<f64>,
}

/// ‖out − reference‖ / ‖max(|reference|, magnitude)‖ (NaN fails): relative to the size of the
/// summed terms, so a sum that cancels is not held to a relative bound it cannot meet.
fn error_vs_terms(out: &[f64], reference: &[f64], magnitude: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((&o, &r), &m) in out.iter().zip(reference).zip(magnitude) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r.abs().max(m).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// A contiguous tensor of `n` elements; `odd` makes it a view at element offset 1.
fn rand_view(
    n: usize,
    dtype: DType,
    dev: Device,
    seed: u64,
    lo: f64,
    hi: f64,
    odd: bool,
) -> Result<Tensor> {
    if odd {
        Tensor::rand(&[n + 1], dtype, dev, seed, lo, hi)?.narrow(0, 1, n)
    } else {
        Tensor::rand(&[n], dtype, dev, seed, lo, hi)
    }
}

fn reference_step(s: &mut State, g: &[f64], hp: &AdamWHyper, t: u64) {
    let (b1, b2) = (hp.beta1, hp.beta2);
    let bc1 = 1.0 - b1.powi(t as i32);
    let bc2 = 1.0 - b2.powi(t as i32);
    for (i, &gr) in g.iter().enumerate() {
        let gi = gr * hp.grad_scale;
        s.rp[i] *= 1.0 - hp.lr * hp.weight_decay;
        s.rm[i] += (1.0 - b1) * (gi - s.rm[i]);
        s.rm_mag[i] = b1 * s.rm_mag[i] + (1.0 - b1) * gi.abs();
        s.rv[i] = b2 * s.rv[i] + (1.0 - b2) * gi * gi;
        let denom = s.rv[i].sqrt() / bc2.sqrt() + hp.eps;
        s.rp[i] -= hp.lr / bc1 * s.rm[i] / denom;
    }
}

fn check_one(
    dev: Device,
    pd: DType,
    gd: DType,
    variant: &str,
    c: &Case,
    seed: u64,
) -> Result<(f64, String)> {
    let mut rng = Rng::new(seed);
    let last = c.sizes.len() - 1;
    let mut st = Vec::new();
    for (i, &n) in c.sizes.iter().enumerate() {
        let odd = i == last && c.sizes.len() > 1;
        let master = (pd == DType::BF16)
            .then(|| rand_view(n, DType::F32, dev, rng.next_u64(), -1.0, 1.0, odd))
            .transpose()?;
        let param = match &master {
            // The bf16 param starts as its master rounded, as a mixed-precision setup has it.
            Some(w) => {
                let b = Tensor::empty(&[n], DType::BF16, Device::Cpu)?;
                b.write_f32(&w.to_vec::<f32>()?)?;
                b.to_device(dev)?
            }
            None => rand_view(n, DType::F32, dev, rng.next_u64(), -1.0, 1.0, odd)?,
        };
        let m = rand_view(n, DType::F32, dev, rng.next_u64(), -0.01, 0.01, odd)?;
        let v = rand_view(n, DType::F32, dev, rng.next_u64(), 0.0, 1e-4, false)?;
        let rp = master.as_ref().unwrap_or(&param).to_f64_vec()?;
        let (rm, rv) = (m.to_f64_vec()?, v.to_f64_vec()?);
        let rm_mag = rm.iter().map(|x| x.abs()).collect();
        st.push(State {
            param,
            master,
            m,
            v,
            rp,
            rm,
            rv,
            rm_mag,
        });
    }
    let opts = AdamWOptions {
        variant: Some(variant.into()),
        stream: None,
    };
    for t in 1..=c.steps {
        let grads = c
            .sizes
            .iter()
            .map(|&n| Tensor::rand(&[n], gd, dev, rng.next_u64(), -0.1, 0.1))
            .collect::<Result<Vec<_>>>()?;
        let list: Vec<AdamWTensor> = st
            .iter()
            .zip(&grads)
            .map(|(s, g)| AdamWTensor {
                param: &s.param,
                grad: g,
                exp_avg: &s.m,
                exp_avg_sq: &s.v,
                master: s.master.as_ref(),
            })
            .collect();
        let hp = AdamWHyper { step: t, ..c.hyper };
        adamw_step(&list, &hp, &opts)?;
        for (s, g) in st.iter_mut().zip(&grads) {
            reference_step(s, &g.to_f64_vec()?, &hp, t);
        }
    }
    let (mut worst, mut what) = (0.0f64, String::new());
    for (i, s) in st.iter().enumerate() {
        let p = s.master.as_ref().unwrap_or(&s.param);
        for (name, e) in [
            (
                if s.master.is_some() {
                    "master"
                } else {
                    "param"
                },
                rel_error(&p.to_f64_vec()?, &s.rp),
            ),
            (
                "exp_avg",
                error_vs_terms(&s.m.to_f64_vec()?, &s.rm, &s.rm_mag),
            ),
            ("exp_avg_sq", rel_error(&s.v.to_f64_vec()?, &s.rv)),
        ] {
            if e > worst || e.is_nan() {
                (worst, what) = (e, format!("tensors[{i}].{name}"));
            }
        }
        if let Some(w) = &s.master {
            // The bf16 param is exactly the master rounded to nearest.
            let want: Vec<half::bf16> = w
                .to_vec::<f32>()?
                .into_iter()
                .map(half::bf16::from_f32)
                .collect();
            if s.param.to_vec::<half::bf16>()? != want {
                return Ok((f64::INFINITY, format!("tensors[{i}].param ≠ bf16(master)")));
            }
        }
    }
    Ok((worst, format!("worst: {what}")))
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for (pd, gd) in [
                (DType::F32, DType::F32),
                (DType::BF16, DType::BF16),
                (DType::BF16, DType::F32),
            ] {
                if !cfg.wants_dtype(pd) {
                    continue;
                }
                for c in cases(cfg.quick) {
                    let n: usize = c.sizes.iter().sum();
                    let label = format!(
                        "{} tensors, {n} elements, {} steps, grad {gd}{}",
                        c.sizes.len(),
                        c.steps,
                        if pd == DType::BF16 {
                            ", f32 master"
                        } else {
                            ""
                        }
                    );
                    // The update is fp32 arithmetic on fp32 state whatever the param dtype.
                    out.push(match check_one(dev, pd, gd, v.name, &c, rng.next_u64()) {
                        Ok((e, note)) => CheckRecord::compared(
                            OP,
                            v.name,
                            dev,
                            pd,
                            Precision::F32,
                            label,
                            e,
                            note,
                        ),
                        Err(e) => CheckRecord::errored(OP, v.name, dev, pd, label, e.to_string()),
                    });
                }
            }
        }
    }
    Ok(())
}
