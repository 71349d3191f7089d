//! The model the trainer runs: parameters, gradients, master weights and AdamW moments in flat
//! buffers, activations for one (B, T), the optimizer step, gradient accumulation and norm, the
//! CUDA-graph replay of a step and a per-op profile. The two families' forward and backward
//! passes are in `passes`.

use super::arena::Arena;
use super::config::ModelConfig;
use super::glue;
use super::passes::Acts;
pub use super::passes::{Block, ParamLayout, Params};
use crate::core::cuda::GpuTimer;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use crate::ops::adamw::{self, cuda::AdamWPlan, AdamWHyper, AdamWOptions, AdamWTensor};
use std::cell::RefCell;
use std::time::Instant;

struct Mark {
    label: &'static str,
    event: Option<GpuTimer>,
    host: Instant,
}

/// One line of a step's profile.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileRow {
    /// The op or pass (`embed`, `norm`, `qkv`, `attention`, ...).
    pub label: String,
    /// Times it ran in the step.
    pub calls: usize,
    /// GPU time over those calls (CUDA events), ms.
    pub gpu_ms: f64,
    /// Host time spent issuing them, ms.
    pub host_ms: f64,
}

/// Options of the model's op calls.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Attention backward without atomics (same bits every run).
    pub deterministic: bool,
    /// Keep one shared buffer for the norms' outputs and the MLP's hidden activation instead of
    /// one per layer, and recompute them in the backward (GPT-2 124M at B 16 × T 1024: 6 of 16
    /// activation rows of width dim per layer, ~1.8 GB).
    pub recompute: bool,
}

/// The model: parameters, gradients, AdamW state and activations for one (B, T).
pub struct Model {
    /// The captured forward + backward (CUDA), replayed by `train_step`; dropped first.
    graph: Option<(cudarc::driver::CudaGraph, f32)>,
    graph_error: Option<String>,
    /// The model's shape.
    pub cfg: ModelConfig,
    /// The dtype of parameters and activations (bf16 on the GPU, f32 on the CPU).
    pub dtype: DType,
    /// Where everything lives.
    pub device: Device,
    /// Where each parameter sits in the flat buffers.
    pub layout: ParamLayout,
    pub(crate) opts: ModelOptions,
    /// The parameters, as views of one flat buffer.
    pub params: Params,
    /// Their gradients, laid out the same.
    pub grads: Params,
    acts: Option<Acts>,
    /// (param, grad, m, v, master) of the decayed and the other group.
    groups: Vec<[Option<Tensor>; 5]>,
    plans: Vec<AdamWPlan>,
    /// Gradient accumulation (f32) when a step takes several micro-batches.
    acc_groups: Vec<Tensor>,
    acc_whole: Option<Tensor>,
    acc_plans: Vec<AdamWPlan>,
    grads_whole: Tensor,
    /// Marks of a profiled step (see `profile_begin`).
    prof: RefCell<Option<Vec<Mark>>>,
    // the views above borrow these arenas: declared last, dropped last
    param_arena: Arena,
    _grad_arena: Arena,
    master_arena: Option<Arena>,
    m_arena: Arena,
    v_arena: Arena,
    acc_arena: Option<Arena>,
}

impl Model {
    /// A freshly initialised model (`seed`) in `dtype` (f32 or bf16; bf16 keeps f32 master
    /// weights for AdamW) on `device`.
    pub fn new(
        cfg: &ModelConfig,
        dtype: DType,
        device: Device,
        seed: u64,
        opts: ModelOptions,
    ) -> Result<Model> {
        cfg.validate(None)?;
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(Error::bad_arg("train", "dtype", "f32 or bf16", dtype));
        }
        let layout = ParamLayout::new(cfg);
        let len = layout.len();
        let param_arena = Arena::new(len, dtype, device)?;
        let grad_arena = Arena::new(len, dtype, device)?;
        let master_arena = (dtype == DType::BF16)
            .then(|| Arena::new(len, DType::F32, device))
            .transpose()?;
        let m_arena = Arena::new(len, DType::F32, device)?;
        let v_arena = Arena::new(len, DType::F32, device)?;
        let init = layout.init(cfg, seed);
        glue::upload(&param_arena.whole()?, &init)?;
        if let Some(m) = &master_arena {
            glue::upload(&m.whole()?, &init)?;
        }
        let params = layout.cut(&param_arena)?;
        let grads = layout.cut(&grad_arena)?;
        let ranges = [
            (0, layout.decay_len),
            (layout.decay_len, len - layout.decay_len),
        ];
        let groups = ranges
            .iter()
            .map(|&(o, n)| -> Result<[Option<Tensor>; 5]> {
                Ok([
                    Some(param_arena.view(o, &[n])?),
                    Some(grad_arena.view(o, &[n])?),
                    Some(m_arena.view(o, &[n])?),
                    Some(v_arena.view(o, &[n])?),
                    master_arena.as_ref().map(|a| a.view(o, &[n])).transpose()?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let grads_whole = grad_arena.whole()?;
        let mut model = Model {
            graph: None,
            graph_error: None,
            cfg: cfg.clone(),
            dtype,
            device,
            layout,
            opts,
            params,
            grads,
            acts: None,
            groups,
            plans: vec![],
            acc_groups: vec![],
            acc_whole: None,
            acc_plans: vec![],
            grads_whole,
            prof: RefCell::new(None),
            param_arena,
            _grad_arena: grad_arena,
            master_arena,
            m_arena,
            v_arena,
            acc_arena: None,
        };
        model.plans = model.make_plans(false)?;
        Ok(model)
    }

    fn adamw_tensors<'a>(g: &'a [Option<Tensor>; 5], grad: &'a Tensor) -> AdamWTensor<'a> {
        AdamWTensor {
            param: g[0].as_ref().unwrap(),
            grad,
            exp_avg: g[2].as_ref().unwrap(),
            exp_avg_sq: g[3].as_ref().unwrap(),
            master: g[4].as_ref(),
        }
    }

    fn make_plans(&self, acc: bool) -> Result<Vec<AdamWPlan>> {
        if !self.device.is_cuda() {
            return Ok(vec![]);
        }
        self.groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let grad = if acc {
                    &self.acc_groups[i]
                } else {
                    g[1].as_ref().unwrap()
                };
                AdamWPlan::new(&[Self::adamw_tensors(g, grad)], None)
            })
            .collect()
    }

    /// Enables gradient accumulation into an f32 buffer (micro-batches per step > 1).
    pub fn enable_accumulation(&mut self) -> Result<()> {
        if self.acc_arena.is_some() {
            return Ok(());
        }
        let len = self.layout.len();
        let a = Arena::new(len, DType::F32, self.device)?;
        let d = self.layout.decay_len;
        self.acc_groups = vec![a.view(0, &[d])?, a.view(d, &[len - d])?];
        self.acc_whole = Some(a.whole()?);
        self.acc_arena = Some(a);
        self.acc_plans = self.make_plans(true)?;
        Ok(())
    }

    /// Allocates activations for (B, T) (reused while the shape stays).
    pub fn prepare(&mut self, batch: usize, seq: usize) -> Result<()> {
        self.cfg.validate(Some(seq))?;
        if let Some(a) = &self.acts {
            if a.batch == batch && a.seq == seq {
                return Ok(());
            }
        }
        self.graph = None;
        self.acts = None;
        self.acts = Some(Acts::new(
            &self.cfg,
            batch,
            seq,
            self.dtype,
            self.device,
            self.opts.recompute,
        )?);
        Ok(())
    }

    /// Bytes the model needs for (B, T): parameters, gradients, AdamW state, activations.
    /// Bytes the model needs for (B, T): parameters, gradients, AdamW state, activations and the
    /// backward's scratch (an estimate within a few percent: kernels' own scratch aside).
    pub fn estimate_bytes(
        cfg: &ModelConfig,
        dtype: DType,
        batch: usize,
        seq: usize,
        accumulate: bool,
        recompute: bool,
    ) -> u64 {
        let es = dtype.size_in_bytes() as u64;
        let p = ParamLayout::new(cfg).len() as u64;
        let master = if dtype == DType::BF16 { 4 } else { 0 };
        let state = p * (2 * es + 8 + master + if accumulate { 4 } else { 0 });
        let (n, c, l) = ((batch * seq) as u64, cfg.dim as u64, cfg.layers as u64);
        let (w, up, f) = (
            cfg.qkv_width() as u64,
            cfg.up_width() as u64,
            cfg.ffn as u64,
        );
        let kept = if recompute {
            w + 2 * c + up
        } else {
            w + 4 * c + up + f
        };
        let per_layer = n * kept * es + n * 16 + (batch * cfg.heads * seq) as u64 * 4;
        let shared = if recompute { n * (2 * c + f) * es } else { 0 };
        let scratch = n
            * (4 * c
                + w
                + f
                + if cfg.family == super::config::Family::Llama {
                    up
                } else {
                    0
                })
            * es;
        let acts = l * per_layer
            + (l + 1) * n * c * es
            + n * cfg.padded_vocab() as u64 * es
            + shared
            + scratch;
        state + acts
    }

    /// Copies a batch's `[B, T+1]` token rows into the model's own buffer (i32).
    pub fn load_tokens(&self, tokens: &Tensor) -> Result<()> {
        let a = self.acts()?;
        if tokens.shape() != a.tokens.shape() || tokens.dtype() != DType::I32 {
            return Err(Error::bad_arg(
                "train",
                "tokens",
                format!("i32 {:?} (the prepared batch)", a.tokens.shape()),
                crate::core::tensor::describe(tokens),
            ));
        }
        if !tokens.device().is_cuda() {
            // On the CPU the check is free; on the GPU a bad id shows as a NaN loss instead
            // (reading it back here would cost a synchronisation per step).
            let v = tokens.to_vec::<i32>()?;
            if let Some(i) = v
                .iter()
                .position(|&x| x < 0 || x as usize >= self.cfg.vocab)
            {
                let row = tokens.shape()[1];
                return Err(Error::bad_arg(
                    "train",
                    "tokens",
                    format!("ids in [0, {}) (the model's vocabulary)", self.cfg.vocab),
                    format!("{} at row {}, position {}", v[i], i / row, i % row),
                ));
            }
        }
        glue::split_tokens(tokens, &a.inputs, &a.targets)?;
        self.mark("tokens")
    }

    pub(crate) fn acts(&self) -> Result<&Acts> {
        self.acts
            .as_ref()
            .ok_or_else(|| Error::Other("train: model.prepare(batch, seq) was not called".into()))
    }

    /// Forward and backward of the loaded tokens (as `forward(Some(dloss))` then `backward()`),
    /// through a CUDA graph when `graph` is set and the device is a GPU: the first call captures
    /// every launch of the two passes (nothing runs on the host per op afterwards), later calls
    /// replay it. The graph reads the model's own token buffers, so `load_tokens` before each call
    /// is all a step changes. Not for the first steps of a run: kernels compile and tuners time
    /// their candidates at first use, which a capture cannot do.
    pub fn train_step(&mut self, dloss: f32, graph: bool) -> Result<()> {
        if !graph || !self.device.is_cuda() || self.prof.borrow().is_some() {
            self.forward(Some(dloss))?;
            return self.backward();
        }
        if self.graph.as_ref().is_some_and(|(_, d)| *d != dloss) {
            self.graph = None;
        }
        if self.graph.is_none() {
            if self.graph_error.is_some() {
                self.forward(Some(dloss))?;
                return self.backward();
            }
            match self.capture(dloss) {
                Ok(g) => self.graph = Some((g, dloss)),
                Err(e) => {
                    // Run this step (and the rest) op by op; a real error shows again there.
                    self.graph_error = Some(e.to_string());
                    self.forward(Some(dloss))?;
                    return self.backward();
                }
            }
        }
        let (g, _) = self.graph.as_ref().unwrap();
        g.launch()
            .map_err(|e| Error::cuda("launching the training step's CUDA graph", e))
    }

    fn capture(&self, dloss: f32) -> Result<cudarc::driver::CudaGraph> {
        let crate::core::device::Device::Cuda(i) = self.device else {
            unreachable!("capture on a CPU model")
        };
        let dev = crate::core::cuda::device(i)?;
        let stream = dev.stream().clone();
        let cap = |e: cudarc::driver::DriverError| {
            Error::cuda("CUDA graph capture of the training step", e)
        };
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(cap)?;
        let passes = self.forward(Some(dloss)).and_then(|_| self.backward());
        // The capture ends whatever happened, so the stream is usable again.
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        passes?;
        graph
            .map_err(cap)?
            .ok_or_else(|| Error::Other("train: the captured training step is empty".into()))
    }

    /// Why the training step could not be captured as a CUDA graph (it then runs op by op).
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }

    /// After a micro-batch's backward with accumulation on: acc = grads (first) or acc += grads.
    pub fn accumulate(&self, first: bool) -> Result<()> {
        let acc = self
            .acc_whole
            .as_ref()
            .ok_or_else(|| Error::Other("train: accumulation not enabled".into()))?;
        glue::accumulate(acc, &self.grads_whole, first)?;
        self.mark("accumulate")
    }

    /// Data parallelism: the step's gradient (accumulated if enabled) summed over every rank of
    /// `pg`, in place (NCCL on the GPU). Each rank's backward is scaled by 1/world, so the sum
    /// is the mean over the global batch.
    pub fn all_reduce_grads(&self, pg: &crate::dist::ProcessGroup) -> Result<()> {
        pg.all_reduce_sum(self.acc_whole.as_ref().unwrap_or(&self.grads_whole))?;
        self.mark("all-reduce")
    }

    /// Σ g² of the step's gradient (accumulated if enabled) into `sumsq_tensor()`.
    pub fn grad_sumsq(&self) -> Result<()> {
        let a = self.acts()?;
        let g = self.acc_whole.as_ref().unwrap_or(&self.grads_whole);
        glue::sumsq(g, Some(&a.parts), &a.sumsq)?;
        self.mark("grad norm")
    }

    /// One AdamW step over both groups (weight decay on the first only).
    pub fn optimizer_step(&self, hp: &AdamWHyper) -> Result<()> {
        let wd = [hp.weight_decay, 0.0];
        let acc = self.acc_whole.is_some();
        if self.device.is_cuda() {
            let plans = if acc { &self.acc_plans } else { &self.plans };
            for (plan, wd) in plans.iter().zip(wd) {
                plan.step(
                    &AdamWHyper {
                        weight_decay: wd,
                        ..*hp
                    },
                    None,
                )?;
            }
            return self.mark("adamw");
        }
        for (i, g) in self.groups.iter().enumerate() {
            let grad = if acc {
                &self.acc_groups[i]
            } else {
                g[1].as_ref().unwrap()
            };
            adamw::adamw_step(
                &[Self::adamw_tensors(g, grad)],
                &AdamWHyper {
                    weight_decay: wd[i],
                    ..*hp
                },
                &AdamWOptions::default(),
            )?;
        }
        self.mark("adamw")
    }

    /// Starts profiling: from here each op records a mark (a GPU event and the host clock) until
    /// `profile_end`. Costs an event record per op; meant for one step.
    pub fn profile_begin(&self) -> Result<()> {
        *self.prof.borrow_mut() = Some(Vec::new());
        self.mark("start")
    }

    /// Ends profiling: per label, calls, GPU ms (time between the previous op's mark and this
    /// one's on the stream) and host ms (the same on the host clock), in first-seen order.
    pub fn profile_end(&self) -> Result<Vec<ProfileRow>> {
        let Some(marks) = self.prof.borrow_mut().take() else {
            return Ok(vec![]);
        };
        let mut rows: Vec<ProfileRow> = Vec::new();
        for w in marks.windows(2) {
            let gpu = match (&w[0].event, &w[1].event) {
                (Some(a), Some(b)) => a.gap_ms(b)?,
                _ => 0.0,
            };
            let host = (w[1].host - w[0].host).as_secs_f64() * 1e3;
            match rows.iter_mut().find(|r| r.label == w[1].label) {
                Some(r) => {
                    r.calls += 1;
                    r.gpu_ms += gpu;
                    r.host_ms += host;
                }
                None => rows.push(ProfileRow {
                    label: w[1].label.to_string(),
                    calls: 1,
                    gpu_ms: gpu,
                    host_ms: host,
                }),
            }
        }
        Ok(rows)
    }

    pub(crate) fn mark(&self, label: &'static str) -> Result<()> {
        let mut p = self.prof.borrow_mut();
        let Some(marks) = p.as_mut() else {
            return Ok(());
        };
        let event = match self.device {
            crate::core::device::Device::Cuda(i) => {
                let dev = crate::core::cuda::device(i)?;
                let t = GpuTimer::new(&dev)?;
                t.start(dev.stream())?;
                t.stop(dev.stream())?;
                Some(t)
            }
            crate::core::device::Device::Cpu => None,
        };
        marks.push(Mark {
            label,
            event,
            host: Instant::now(),
        });
        Ok(())
    }

    /// The last forward's mean loss (f32, one element, on the device).
    pub fn loss_tensor(&self) -> Result<&Tensor> {
        Ok(&self.acts()?.loss)
    }
    /// The gradients' sum of squares from `grad_sumsq` (f32, one element, on the device).
    pub fn sumsq_tensor(&self) -> Result<&Tensor> {
        Ok(&self.acts()?.sumsq)
    }
    /// The logits `[B·T, vocab]` (a view of the padded buffer) after a forward without
    /// gradient.
    pub fn logits(&self) -> Result<Tensor> {
        self.acts()?.logits.narrow(1, 0, self.cfg.vocab)
    }
    /// The flat parameter buffer (checkpoints, tests).
    pub fn param_buffer(&self) -> &Tensor {
        self.param_arena.owner()
    }
    /// The flat f32 master weights (bf16 models) and AdamW moments.
    pub fn state_buffers(&self) -> (Option<&Tensor>, &Tensor, &Tensor) {
        (
            self.master_arena.as_ref().map(|a| a.owner()),
            self.m_arena.owner(),
            self.v_arena.owner(),
        )
    }
    /// The flat gradient buffer of the last backward.
    pub fn grad_buffer(&self) -> &Tensor {
        &self.grads_whole
    }
}
