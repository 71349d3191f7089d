//! # train — a GPT trained end to end from token shards, with explicit forward and backward
//! calls into ferrite's op families (no autograd), as llm.c's `train_gpt2` does.
//!
//! - [`config`]: model presets (GPT-2 124M/350M/774M, a tiny CPU model) and the run's settings
//!   (batch, sequence, accumulation, AdamW, clipping, warm-up + cosine/WSD schedule).
//! - [`model`]: the model — parameters, gradients and AdamW state in flat buffers, activations
//!   for one (B, T), forward, backward, optimizer step.
//! - [`glue`]: the small passes between families (token split, embedding forward/backward,
//!   in-place add, accumulation, gradient norm), CPU and CUDA.
//! - [`run`]: the loop — ferrite's loader feeding the model, clipping, the schedule, validation,
//!   a log line per step; [`run_dist`]: the same loop as one rank of a data-parallel run
//!   (gradients all-reduced over [`crate::dist`], or ZeRO-1).
//!
//! On the GPU every tensor is bf16 (f32 master weights and moments for AdamW); on the CPU f32.

pub mod arena;
pub mod checkpoint;
pub mod config;
pub mod glue;
pub mod hf;
pub mod model;
pub mod passes;
pub mod sample;
#[cfg(test)]
mod tests;

pub use config::{Family, ModelConfig, Schedule, TrainConfig};
pub use model::{FlatState, Model, ModelOptions, ProfileRow, Shard};

use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::data::{Dataset, Loader, LoaderConfig};
use crate::ops::adamw::AdamWHyper;
use std::path::PathBuf;
use std::time::Instant;

/// Everything a run needs besides the model and training settings.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Training shards: a folder with `index.json`, or one shard file.
    pub data: PathBuf,
    /// Validation shards (evaluated every `TrainConfig::val_every` steps).
    pub val_data: Option<PathBuf>,
    /// Where to train.
    pub device: Device,
    /// Parameters' and activations' dtype (bf16 on the GPU, f32 on the CPU by default).
    pub dtype: DType,
    /// The model's shape.
    pub model: ModelConfig,
    /// The run's settings.
    pub train: TrainConfig,
    /// Same bits every run (the attention backward without atomics).
    pub deterministic: bool,
    /// Dense bf16 peak in TFLOP/s that MFU is measured against.
    pub peak_tflops: f64,
    /// Profile this step (0-based): per op, GPU and host time (in `Summary::profile`).
    pub profile_step: Option<usize>,
    /// Replay the forward + backward as a CUDA graph from the third step on (GPU).
    pub graph: bool,
    /// Save a checkpoint to `save/step-NNNNNN` every `save_every` steps and after the last.
    pub save: Option<PathBuf>,
    /// Steps between checkpoints (0: only after the last step).
    pub save_every: usize,
    /// Continue the run saved in this checkpoint folder (exactly: weights, AdamW state, step,
    /// loader position).
    pub resume: Option<PathBuf>,
    /// Start from Hugging Face GPT-2 weights (a folder with model.safetensors, or the file).
    pub init_hf: Option<PathBuf>,
    /// Recompute the norms' outputs and the MLP activation in the backward (less memory).
    pub recompute: bool,
    /// Append every batch's `[B, T+1]` token rows (i32, little-endian) to this file, so a peer can
    /// train on exactly the same batches (`scripts/gpu-suite/train_peers.py --batches`). With
    /// several ranks each writes `FILE.rankR`.
    pub dump_batches: Option<PathBuf>,
    /// With several ranks ([`run_dist`]): ZeRO-1 — each rank keeps 1/world of the master weights
    /// and AdamW moments; gradients are reduce-scattered, each rank updates its shard, and the
    /// weights are all-gathered (the same traffic as an all-reduce).
    pub zero: bool,
    /// With several ranks on GPUs (plain data parallelism, no accumulation): all-reduce each
    /// layer's gradients while the backward goes on (default), instead of all of them after it.
    pub overlap: bool,
}

impl RunOptions {
    /// A run of `model` on `data` with the defaults for everything else.
    pub fn new(
        data: PathBuf,
        device: Device,
        model: ModelConfig,
        train: TrainConfig,
    ) -> RunOptions {
        RunOptions {
            data,
            val_data: None,
            device,
            dtype: if device.is_cuda() {
                DType::BF16
            } else {
                DType::F32
            },
            model,
            train,
            deterministic: false,
            peak_tflops: 1.0,
            profile_step: None,
            graph: true,
            save: None,
            save_every: 0,
            resume: None,
            init_hf: None,
            recompute: false,
            dump_batches: None,
            zero: false,
            overlap: true,
        }
    }
}

/// One optimizer step as the log shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepLog {
    /// The step's number, from 0.
    pub step: usize,
    /// Mean training loss over the step's micro-batches.
    pub loss: f64,
    /// The learning rate used.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step, ms.
    pub ms: f64,
    /// Training tokens per second.
    pub tokens_per_s: f64,
    /// Model FLOP utilisation against `RunOptions::peak_tflops`.
    pub mfu: f64,
    /// Share of the step spent waiting for the loader.
    pub data_wait: f64,
    /// The validation loss, on steps that evaluate.
    pub val_loss: Option<f64>,
    /// Device memory in use by ferrite's pool (GPU), GiB.
    pub mem_gib: f64,
    /// Host time spent queuing the step's work (before waiting for its results), ms.
    pub host_ms: f64,
    /// The update was skipped (non-finite loss or gradient, with `skip_nonfinite`).
    pub skipped: bool,
}

/// The end of a run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    /// The model's name.
    pub model: String,
    /// The device's name.
    pub device: String,
    /// Parameter count.
    pub params: usize,
    /// B (per rank).
    pub batch: usize,
    /// Ranks (processes) that trained together; tokens/s counts all of them.
    pub world: usize,
    /// T.
    pub seq: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Steps configured.
    pub steps: usize,
    /// The first step's loss.
    pub first_loss: f64,
    /// The last step's loss.
    pub last_loss: f64,
    /// The last validation loss, if any.
    pub last_val_loss: Option<f64>,
    /// Median over the steps after the first few (warm-up: compilation, tuning).
    pub tokens_per_s: f64,
    /// Median step time over the same steps, ms.
    pub step_ms: f64,
    /// Median host time per step queuing work (see `StepLog::host_ms`).
    pub host_ms: f64,
    /// Whether the steps after the first two replayed a CUDA graph.
    pub graph: bool,
    /// Why the step could not be captured (it then ran op by op).
    pub graph_error: Option<String>,
    /// MFU at the median throughput.
    pub mfu: f64,
    /// Median share of a step spent waiting for data.
    pub data_wait: f64,
    /// Peak device memory of ferrite's pool, GiB (GPU).
    pub peak_gib: f64,
    /// The profiled step's ops (empty unless asked for).
    pub profile: Vec<ProfileRow>,
    /// Every step's log.
    pub log: Vec<StepLog>,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn scalar(t: &crate::core::tensor::Tensor) -> Result<f64> {
    Ok(t.to_f32_vec()?[0] as f64)
}

/// The loader for a run (tokens as i32 on the run's device); `shard` = (rank, world) reads
/// this rank's rows of each global batch.
fn loader(
    ds: &Dataset,
    o: &RunOptions,
    shuffle: bool,
    epochs: Option<u64>,
    resume: Option<crate::data::LoaderState>,
    shard: (usize, usize),
) -> Result<Loader> {
    let cfg = LoaderConfig {
        batch: o.train.batch,
        seq: o.train.seq,
        seed: o.train.seed,
        shuffle,
        epochs,
        device: o.device,
        out_dtype: Some(DType::I32),
        rank: shard.0,
        world: shard.1,
        ..Default::default()
    };
    Loader::new(ds, cfg, resume)
}

/// Mean loss over the first `batches` batches of the validation set.
fn evaluate(model: &Model, ds: &Dataset, o: &RunOptions) -> Result<f64> {
    let mut l = loader(ds, o, false, Some(1), None, (0, 1))?;
    let (mut sum, mut n) = (0.0, 0);
    while n < o.train.val_batches {
        let Some(b) = l.next_batch()? else { break };
        model.load_tokens(&b.tokens)?;
        drop(b);
        model.forward(None)?;
        sum += scalar(model.loss_tensor()?)?;
        n += 1;
    }
    if n == 0 {
        return Err(Error::bad_arg(
            "train",
            "val_data",
            format!(
                "at least one batch of {}×{} tokens",
                o.train.batch,
                o.train.seq + 1
            ),
            "a validation set too small for one batch",
        ));
    }
    Ok(sum / n as f64)
}

/// Trains `o.model` on `o.data` for `o.train.steps` steps; `on_step` sees every step's log.
pub fn run(o: &RunOptions, on_step: &mut dyn FnMut(&StepLog)) -> Result<Summary> {
    run_in(o, None, on_step)
}

/// Data-parallel training: this process is one rank of `pg` (every rank calls this with the
/// same options, each on its own device). Each rank reads its `B` rows of every global batch of
/// `world · B`, runs forward and backward on them, and the gradients are summed over the ranks
/// before the norm, the clipping and the update, which every rank then does alike: the weights
/// stay identical, and the run equals one process training on the global batch. Rank 0 writes
/// the checkpoints; a checkpoint resumes on any number of ranks. Losses and throughput in the
/// log and the summary are global. On GPUs a [`crate::dist::Watchdog`] ends the process (exit
/// status 3, the rank and step named on stderr) when a step runs past `FERRITE_DIST_TIMEOUT`:
/// a peer that died or hangs leaves this rank waiting inside NCCL, which has no timeout.
pub fn run_dist(
    o: &RunOptions,
    pg: &mut crate::dist::ProcessGroup,
    on_step: &mut dyn FnMut(&StepLog),
) -> Result<Summary> {
    pg.attach(o.device)?;
    // Everything that shapes the numbers must agree (paths and the device index may differ).
    let shape = serde_json::json!({
        "model": &o.model,
        "train": &o.train,
        "dtype": o.dtype.name(),
        "deterministic": o.deterministic,
        "recompute": o.recompute,
        "resume": o.resume.as_ref().map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
        "init_hf": o.init_hf.is_some(),
        "val": o.val_data.is_some(),
        "zero": o.zero,
        "overlap": o.overlap,
    });
    pg.check_same("the run's settings", &shape.to_string())?;
    run_in(o, Some(pg), on_step)
}

fn run_in(
    o: &RunOptions,
    pg: Option<&mut crate::dist::ProcessGroup>,
    on_step: &mut dyn FnMut(&StepLog),
) -> Result<Summary> {
    let pg = pg.map(|p| &*p);
    let (rank, world) = pg.map_or((0, 1), |p| (p.rank(), p.world()));
    let t = &o.train;
    t.validate()?;
    o.model.validate(Some(t.seq))?;
    let accumulate = t.grad_accum > 1;
    if let Device::Cuda(i) = o.device {
        let need =
            Model::estimate_bytes(&o.model, o.dtype, t.batch, t.seq, accumulate, o.recompute);
        let dev = crate::core::cuda::device(i)?;
        dev.bind()?;
        let (free, _total) =
            cudarc::driver::result::mem_get_info().map_err(|e| Error::cuda("cuMemGetInfo", e))?;
        if need as f64 > free as f64 * 0.97 {
            return Err(Error::bad_arg(
                "train",
                "batch/seq/model",
                format!("a configuration that fits the GPU's {:.1} GiB free", free as f64 / (1u64 << 30) as f64),
                format!(
                    "{} at B {} T {} needing about {:.1} GiB (parameters, AdamW state, activations)",
                    o.model.name,
                    t.batch,
                    t.seq,
                    need as f64 / (1u64 << 30) as f64
                ),
            ));
        }
    }
    let ds = Dataset::open(&o.data)?;
    let val = o.val_data.as_ref().map(|p| Dataset::open(p)).transpose()?;
    let mut model = Model::new(
        &o.model,
        o.dtype,
        o.device,
        t.seed,
        ModelOptions {
            deterministic: o.deterministic,
            recompute: o.recompute,
            shard: (o.zero && world > 1).then_some((rank, world)),
        },
    )?;
    model.prepare(t.batch, t.seq)?;
    if accumulate {
        model.enable_accumulation()?;
    }
    if let Some(pg) = pg.filter(|_| o.overlap) {
        model.overlap_all_reduce(pg)?;
    }
    if let Some(p) = &o.init_hf {
        checkpoint::import_hf(&model, p)?;
    }
    let (start, resume_at) = match &o.resume {
        Some(p) => {
            let meta = checkpoint::load_state(&model, p)?;
            (meta.step, meta.loader)
        }
        None => (0, None),
    };
    let mut data = loader(&ds, o, true, None, resume_at, (rank, world))?;
    if let Some(pg) = pg {
        // The same shards, sequence length and order on every rank (its fingerprint).
        pg.check_same(
            "the training data (shards, T, order)",
            &format!("{:016x}", data.state().fingerprint),
        )?;
    }
    let mut dump = match &o.dump_batches {
        Some(p) => {
            let p = if world > 1 {
                let mut n = p.as_os_str().to_owned();
                n.push(format!(".rank{rank}"));
                PathBuf::from(n)
            } else {
                p.clone()
            };
            Some(std::io::BufWriter::new(std::fs::File::create(&p).map_err(
                |e| Error::io(format!("creating {}", p.display()), e),
            )?))
        }
        None => None,
    };
    let tokens_per_step = (t.batch * t.seq * t.grad_accum * world) as f64;
    let flops_per_step = o.model.flops_per_token(t.seq) * tokens_per_step;
    let mut log: Vec<StepLog> = Vec::with_capacity(t.steps);
    // Each rank's share of the mean over the global batch.
    let dloss = 1.0 / (t.grad_accum * world) as f32;
    let watchdog = match pg {
        Some(_) if o.device.is_cuda() => Some(crate::dist::Watchdog::start(
            rank,
            crate::dist::timeout()?,
            Box::new(|m| {
                eprintln!("{m}");
                std::process::exit(3);
            }),
        )),
        _ => None,
    };
    let mut profile = Vec::new();
    for step in start..t.steps {
        let profiling = o.profile_step == Some(step);
        if profiling {
            model.profile_begin()?;
        }
        let t0 = Instant::now();
        if let Some(w) = &watchdog {
            w.begin(step);
        }
        let wait0 = data.stats().wait_s;
        let mut loss = 0.0;
        let mut host = 0.0;
        // Kernels compile and tuners pick at first use: the graph is captured from step 2 on.
        let graph = o.graph && step >= start + 2;
        for micro in 0..t.grad_accum {
            let batch = data.next_batch()?.ok_or_else(|| {
                Error::Other("train: the training set ended (the loader runs forever)".into())
            })?;
            if let Some(w) = dump.as_mut() {
                use std::io::Write;
                let v = batch.tokens.to_vec::<i32>()?;
                w.write_all(bytemuck::cast_slice(&v))
                    .map_err(|e| Error::io("writing the batch dump".to_string(), e))?;
            }
            let h0 = Instant::now();
            model.load_tokens(&batch.tokens)?;
            drop(batch);
            model.train_step(dloss, graph)?;
            if accumulate {
                model.accumulate(micro == 0)?;
            }
            if micro + 1 == t.grad_accum {
                model.reduce_grads(pg)?;
            }
            host += h0.elapsed().as_secs_f64();
            loss += scalar(model.loss_tensor()?)? / t.grad_accum as f64;
        }
        if let Some(pg) = pg {
            let mut v = [loss as f32];
            pg.all_reduce_host(&mut v)?;
            loss = v[0] as f64 / world as f64;
        }
        let norm = scalar(model.sumsq_tensor()?)?.sqrt();
        let finite = loss.is_finite() && norm.is_finite();
        if !finite && !t.skip_nonfinite {
            let first = model.first_nonfinite()?.map_or(String::new(), |n| {
                format!("; the first non-finite tensor: {n}")
            });
            return Err(Error::Other(format!(
                "train: step {step}: non-finite {} (loss {loss}, gradient norm {norm}){first}; a token id ≥ \
                 the vocabulary ({}) gives a NaN embedding row. --skip-nonfinite skips such updates",
                if loss.is_finite() { "gradient" } else { "loss" },
                o.model.vocab
            )));
        }
        let lr = t.lr_at(step);
        if finite {
            let grad_scale = if t.clip > 0.0 && norm > t.clip {
                t.clip / norm
            } else {
                1.0
            };
            model.optimizer_step(&AdamWHyper {
                lr,
                beta1: t.beta1,
                beta2: t.beta2,
                eps: t.eps,
                weight_decay: t.weight_decay,
                step: step as u64 + 1,
                grad_scale,
            })?;
            model.share_update(pg)?;
        }
        // The step ends when the update is done (the next step's loss read waits for it anyway).
        let _ = scalar(model.sumsq_tensor()?)?;
        let secs = t0.elapsed().as_secs_f64();
        if let Some(w) = &watchdog {
            w.end();
        }
        if profiling {
            profile = model.profile_end()?;
        }
        let wait = data.stats().wait_s - wait0;
        let val_loss = match &val {
            Some(v)
                if t.val_every > 0 && ((step + 1) % t.val_every == 0 || step + 1 == t.steps) =>
            {
                Some(evaluate(&model, v, o)?)
            }
            _ => None,
        };
        let mem_gib = match o.device {
            Device::Cuda(i) => {
                crate::core::cuda::device(i)?.pool_usage()?.0 as f64 / (1u64 << 30) as f64
            }
            Device::Cpu => 0.0,
        };
        let entry = StepLog {
            step,
            loss,
            lr,
            grad_norm: norm,
            ms: secs * 1e3,
            tokens_per_s: tokens_per_step / secs,
            mfu: flops_per_step / secs / (o.peak_tflops * 1e12 * world as f64),
            data_wait: wait / secs,
            val_loss,
            mem_gib,
            host_ms: host * 1e3,
            skipped: !finite,
        };
        on_step(&entry);
        log.push(entry);
        if let Some(dir) = &o.save {
            let last = step + 1 == t.steps;
            if last || (o.save_every > 0 && (step + 1) % o.save_every == 0) {
                let meta = checkpoint::Meta {
                    model: o.model.clone(),
                    train: t.clone(),
                    step: step + 1,
                    loader: Some(data.state()),
                    dtype: o.dtype.name().to_string(),
                };
                // The replicas are identical (under ZeRO-1 the optimizer state is gathered
                // first): rank 0 writes, the others wait for it.
                let state = model.flat_state(pg)?;
                if rank == 0 {
                    let to = dir.join(format!("step-{:06}", step + 1));
                    checkpoint::save_state(&model, &state, &to, &meta)?;
                }
                drop(state);
                if let Some(pg) = pg {
                    pg.barrier("checkpoint")?;
                }
            }
        }
    }
    let warm = if log.len() > 4 { 3 } else { 0 };
    let mut tps: Vec<f64> = log[warm..].iter().map(|l| l.tokens_per_s).collect();
    let mut ms: Vec<f64> = log[warm..].iter().map(|l| l.ms).collect();
    let mut wait: Vec<f64> = log[warm..].iter().map(|l| l.data_wait).collect();
    let mut host: Vec<f64> = log[warm..].iter().map(|l| l.host_ms).collect();
    let tokens_per_s = median(&mut tps);
    let peak_gib = match o.device {
        Device::Cuda(i) => {
            crate::core::cuda::device(i)?.pool_usage()?.1 as f64 / (1u64 << 30) as f64
        }
        Device::Cpu => 0.0,
    };
    Ok(Summary {
        model: o.model.name.clone(),
        device: match o.device {
            Device::Cuda(i) => crate::core::cuda::device(i)?.props().name.clone(),
            Device::Cpu => "cpu".into(),
        },
        params: o.model.num_params(),
        batch: t.batch,
        seq: t.seq,
        grad_accum: t.grad_accum,
        steps: t.steps,
        first_loss: log.first().map_or(f64::NAN, |l| l.loss),
        last_loss: log.last().map_or(f64::NAN, |l| l.loss),
        last_val_loss: log.iter().rev().find_map(|l| l.val_loss),
        tokens_per_s,
        step_ms: median(&mut ms),
        host_ms: median(&mut host),
        graph: o.graph && o.device.is_cuda() && model.graph_error().is_none(),
        graph_error: model.graph_error().map(str::to_string),
        mfu: flops_per_step
            / (tokens_per_step / tokens_per_s)
            / (o.peak_tflops * 1e12 * world as f64),
        world,
        data_wait: median(&mut wait),
        peak_gib,
        profile,
        log,
    })
}
