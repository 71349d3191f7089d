//! The Rust trainer's model from Python, for parity tests against a PyTorch reference: a few
//! optimizer steps of `ferrite::train::Model` on given token batches, returning what a reference
//! needs to compare (the parameter layout, initial weights, per-step losses and gradient norms,
//! the first step's gradients and the final weights).

use crate::run_value;
use ferrite::ops::adamw::AdamWHyper;
use ferrite::train::{Model, ModelConfig, ModelOptions};
use ferrite::{DType, Device, Error, Tensor};
use pyo3::prelude::*;

/// (slot name, offset, shape) of every parameter in the flat buffers.
type Layout = Vec<(String, usize, Vec<usize>)>;
/// layout, initial params, losses, gradient norms, step-0 gradients, final params.
type StepsOut = (Layout, Vec<f32>, Vec<f64>, Vec<f64>, Vec<f32>, Vec<f32>);

/// Trains ferrite's GPT-2 (or, with `family="llama"`, Llama) for one optimizer step per batch (constant lr, AdamW β 0.9/0.95,
/// eps 1e-8, weight decay on matrices and embeddings, global-norm clip). `batches`: each a flat
/// list of B·(T+1) token ids. `device`: -1 CPU (f32), ≥ 0 that GPU (bf16, f32 master weights).
#[pyfunction]
#[pyo3(signature = (vocab, max_seq, layers, heads, dim, batch, seq, batches, lr=1e-3, weight_decay=0.1, clip=1.0, seed=1, device=-1, family="gpt2".to_string(), kv_heads=None, ffn=None))]
#[allow(clippy::too_many_arguments)]
pub fn gpt2_train_steps(
    py: Python<'_>,
    vocab: usize,
    max_seq: usize,
    layers: usize,
    heads: usize,
    dim: usize,
    batch: usize,
    seq: usize,
    batches: Vec<Vec<i32>>,
    lr: f64,
    weight_decay: f64,
    clip: f64,
    seed: u64,
    device: i64,
    family: String,
    kv_heads: Option<usize>,
    ffn: Option<usize>,
) -> PyResult<StepsOut> {
    run_value(py, "ferrite.gpt2_train_steps", move || {
        let cfg = match family.as_str() {
            "gpt2" => ModelConfig::gpt2("parity", vocab, max_seq, layers, heads, dim),
            "llama" => ModelConfig::llama(
                "parity",
                vocab,
                max_seq,
                layers,
                heads,
                kv_heads.unwrap_or(heads),
                dim,
                ffn.unwrap_or(4 * dim),
            ),
            other => {
                return Err(Error::bad_arg(
                    "ferrite.gpt2_train_steps",
                    "family",
                    "gpt2 or llama",
                    other,
                ))
            }
        };
        let (dev, dtype) = if device < 0 {
            (Device::Cpu, DType::F32)
        } else {
            (Device::Cuda(device as usize), DType::BF16)
        };
        let mut m = Model::new(
            &cfg,
            dtype,
            dev,
            seed,
            ModelOptions {
                deterministic: true,
                ..Default::default()
            },
        )?;
        m.prepare(batch, seq)?;
        let layout = m.layout.layout.slots.clone();
        let flat = |t: &Tensor| t.to_f32_vec();
        let master = |m: &Model| {
            m.state_buffers()
                .0
                .map_or_else(|| flat(m.param_buffer()), flat)
        };
        let init = master(&m)?;
        let (mut losses, mut norms, mut grads0) = (vec![], vec![], vec![]);
        for (step, b) in batches.iter().enumerate() {
            if b.len() != batch * (seq + 1) {
                return Err(Error::bad_arg(
                    "ferrite.gpt2_train_steps",
                    "batches",
                    format!("lists of B·(T+1) = {} token ids", batch * (seq + 1)),
                    format!("batch {step} with {}", b.len()),
                ));
            }
            let tok = Tensor::from_vec(b.clone(), &[batch, seq + 1])?.to_device(dev)?;
            m.load_tokens(&tok)?;
            m.forward(Some(1.0))?;
            m.backward()?;
            m.reduce_grads(None)?;
            let loss = m.loss_tensor()?.to_f32_vec()?[0] as f64;
            let norm = (m.sumsq_tensor()?.to_f32_vec()?[0] as f64).sqrt();
            if step == 0 {
                grads0 = flat(m.grad_buffer())?;
            }
            m.optimizer_step(&AdamWHyper {
                lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay,
                step: step as u64 + 1,
                grad_scale: if clip > 0.0 && norm > clip {
                    clip / norm
                } else {
                    1.0
                },
            })?;
            losses.push(loss);
            norms.push(norm);
        }
        Ok((layout, init, losses, norms, grads0, master(&m)?))
    })
}
