//! A small classifier trained with ferrite's ops on the CPU: each step is a linear forward
//! (bias and GELU in the first layer's epilogue, the pre-activation kept), cross-entropy with
//! its gradient from the same pass, the two linear backwards (the first applying GELU's
//! derivative to the saved pre-activation), and one fused AdamW step over every tensor.
//!
//! The task: 4 classes of 16-dimensional points, labelled by a fixed random linear teacher; the
//! loss falls from ln 4 ≈ 1.39 towards 0.
//!
//! ```sh
//! cargo run --release -p ferrite --example train_step
//! ```

use ferrite::core::rng::Rng;
use ferrite::ops::adamw::{adamw_step, AdamWHyper, AdamWOptions, AdamWTensor};
use ferrite::ops::cross_entropy::{cross_entropy_into, CrossEntropyOptions, GradOut};
use ferrite::ops::linear::{self, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions};
use ferrite::{DType, Device, Result, Tensor};

const BATCH: usize = 64;
const IN: usize = 16;
const HIDDEN: usize = 64;
const CLASSES: usize = 4;
const STEPS: u64 = 300;

/// A parameter with its gradient and AdamW moments (all f32 on the CPU).
struct Param {
    value: Tensor,
    grad: Tensor,
    m: Tensor,
    v: Tensor,
}

impl Param {
    fn new(shape: &[usize], seed: u64, scale: f64) -> Result<Param> {
        let zeros = || Tensor::empty(shape, DType::F32, Device::Cpu); // zeroed on the CPU
        Ok(Param {
            value: Tensor::rand(shape, DType::F32, Device::Cpu, seed, -scale, scale)?,
            grad: zeros()?,
            m: zeros()?,
            v: zeros()?,
        })
    }
}

fn main() -> Result<()> {
    let cpu = Device::Cpu;
    let (w1, b1) = (
        Param::new(&[HIDDEN, IN], 1, 0.25)?,
        Param::new(&[HIDDEN], 2, 0.0)?,
    );
    let (w2, b2) = (
        Param::new(&[CLASSES, HIDDEN], 3, 0.12)?,
        Param::new(&[CLASSES], 4, 0.0)?,
    );
    let teacher = Tensor::rand(&[CLASSES, IN], DType::F32, cpu, 5, -1.0, 1.0)?.to_vec::<f32>()?;

    // Activations and their gradients, allocated once and reused by every step.
    let buf = |shape: &[usize]| Tensor::empty(shape, DType::F32, cpu);
    let (z1, h, logits) = (
        buf(&[BATCH, HIDDEN])?,
        buf(&[BATCH, HIDDEN])?,
        buf(&[BATCH, CLASSES])?,
    );
    let (dlogits, dh) = (buf(&[BATCH, CLASSES])?, buf(&[BATCH, HIDDEN])?);
    let (loss_rows, loss) = (buf(&[BATCH])?, buf(&[1])?);

    let gelu = LinearOptions {
        activation: Activation::GeluTanh,
        ..Default::default()
    };
    let plain = LinearOptions::default();
    let mut rng = Rng::new(7);
    let mut first = None;
    for step in 1..=STEPS {
        let (x, targets) = batch(&mut rng, &teacher)?;

        // Forward: h = gelu(x·w1ᵀ + b1) (z1 kept), logits = h·w2ᵀ + b2.
        let fc1 = Fwd {
            x: &x,
            w: &w1.value,
            bias: Some(&b1.value),
            residual: None,
        };
        linear::forward_into(
            &fc1,
            &FwdOut {
                y: &h,
                z: Some(&z1),
            },
            &gelu,
        )?;
        let fc2 = Fwd {
            x: &h,
            w: &w2.value,
            bias: Some(&b2.value),
            residual: None,
        };
        linear::forward_into(
            &fc2,
            &FwdOut {
                y: &logits,
                z: None,
            },
            &plain,
        )?;

        // Loss and dlogits in one pass (mean over the batch).
        let ce = CrossEntropyOptions::default();
        cross_entropy_into(
            &logits,
            &targets,
            &loss_rows,
            Some(&loss),
            GradOut::Into(&dlogits),
            &ce,
        )?;

        // Backward: fc2 gives dh, dw2, db2; fc1 applies gelu'(z1) to dh and gives dw1, db1.
        let bwd2 = Bwd {
            dy: &dlogits,
            x: &h,
            w: &w2.value,
            z: None,
            x_pre: None,
        };
        let out2 = BwdOut {
            dx: Some(&dh),
            dw: Some(&w2.grad),
            db: Some(&b2.grad),
            db_pre: None,
        };
        linear::backward_into(&bwd2, &out2, &plain)?;
        let bwd1 = Bwd {
            dy: &dh,
            x: &x,
            w: &w1.value,
            z: Some(&z1),
            x_pre: None,
        };
        let out1 = BwdOut {
            dx: None,
            dw: Some(&w1.grad),
            db: Some(&b1.grad),
            db_pre: None,
        };
        linear::backward_into(&bwd1, &out1, &gelu)?;

        // One AdamW step over all four tensors.
        let list: Vec<AdamWTensor> = [&w1, &b1, &w2, &b2]
            .iter()
            .map(|p| AdamWTensor {
                param: &p.value,
                grad: &p.grad,
                exp_avg: &p.m,
                exp_avg_sq: &p.v,
                master: None,
            })
            .collect();
        let hp = AdamWHyper {
            lr: 1e-2,
            weight_decay: 0.0,
            step,
            ..Default::default()
        };
        adamw_step(&list, &hp, &AdamWOptions::default())?;

        let l = loss.to_vec::<f32>()?[0];
        first.get_or_insert(l);
        if step == 1 || step % 50 == 0 {
            println!("step {step:3}: loss {l:.4}");
        }
    }
    let last = loss.to_vec::<f32>()?[0];
    let first = first.unwrap_or(last);
    println!("loss {first:.3} → {last:.3} in {STEPS} steps");
    if last >= first * 0.5 {
        return Err(ferrite::Error::Other(format!(
            "train_step: the loss did not halve ({first} → {last})"
        )));
    }
    Ok(())
}

/// A batch of uniform points and their teacher labels (i64, as torch's targets).
fn batch(rng: &mut Rng, teacher: &[f32]) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..BATCH * IN)
        .map(|_| rng.uniform(-1.0, 1.0) as f32)
        .collect();
    let labels: Vec<i64> = x
        .chunks(IN)
        .map(|row| {
            let score = |c: usize| -> f32 { (0..IN).map(|i| row[i] * teacher[c * IN + i]).sum() };
            (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0) as i64
        })
        .collect();
    Ok((
        Tensor::from_vec(x, &[BATCH, IN])?,
        Tensor::from_vec(labels, &[BATCH])?,
    ))
}
