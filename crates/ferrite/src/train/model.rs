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

/// The training state as flat buffers of the layout's length (see [`Model::flat_state`]).
pub struct FlatState {
    /// The parameters (the model's dtype).
    pub params: Tensor,
    /// The f32 master weights of a bf16 model.
    pub master: Option<Tensor>,
    /// AdamW's first moment.
    pub exp_avg: Tensor,
    /// AdamW's second moment.
    pub exp_avg_sq: Tensor,
}

/// The gradient buckets all-reduced during the backward: one per layer (its four weight
/// matrices, contiguous in the flat buffer, ready once the layer's backward is done), then the
/// rest once the backward ends (embeddings: the classifier's gradient is finished by the
/// embedding backward, the last pass; biases and norm gains).
struct Overlap {
    gs: crate::dist::GradientStream,
    layers: Vec<Tensor>,
    rest: Vec<Tensor>,
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
    /// ZeRO-1: `(rank, world)` — the f32 master weights and AdamW moments are cut into `world`
    /// equal shards and this model keeps only shard `rank` (see [`Model::shard`]); the
    /// trainer reduce-scatters the gradients, updates its shard, and all-gathers the weights.
    pub shard: Option<(usize, usize)>,
}

/// Where a model's optimizer shard lies in the flat buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This shard's index.
    pub rank: usize,
    /// Shards in all.
    pub world: usize,
    /// Elements per shard (a multiple of the arena alignment).
    pub len: usize,
}

impl Shard {
    /// The shards of a flat buffer of `n` elements over `world` ranks (equal, aligned, the last
    /// padded past `n`).
    pub fn of(n: usize, rank: usize, world: usize) -> Shard {
        let a = super::arena::ALIGN;
        Shard {
            rank,
            world,
            len: n.div_ceil(world * a) * a,
        }
    }
    /// `[lo, hi)` of this shard in the flat buffers.
    pub fn range(&self) -> (usize, usize) {
        (self.rank * self.len, (self.rank + 1) * self.len)
    }
    /// Elements of the padded flat buffers (`world · len`).
    pub fn padded(&self) -> usize {
        self.world * self.len
    }
}

/// The model: parameters, gradients, AdamW state and activations for one (B, T).
pub struct Model {
    /// The captured forward + backward (CUDA), replayed by `train_step`; dropped first.
    graph: Option<(cudarc::driver::CudaGraph, f32)>,
    graph_error: Option<String>,
    /// Data parallelism with the all-reduce overlapped with the backward (see
    /// [`Model::overlap_all_reduce`]); dropped after the graph that may use it.
    overlap: Option<Overlap>,
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
    /// (param, grad, m, v, master) of the decayed and the other group (their parts inside this
    /// model's shard under ZeRO-1), with whether weight decay applies.
    groups: Vec<[Option<Tensor>; 5]>,
    /// (offset in the flat buffers, length, weight decay) of each group.
    spans: Vec<(usize, usize, bool)>,
    /// The optimizer shard (ZeRO-1); `None`: this model holds the whole state.
    shard: Option<Shard>,
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
        let shard = match opts.shard {
            Some((rank, world)) if world > 1 => {
                if rank >= world {
                    return Err(Error::bad_arg(
                        "train",
                        "shard",
                        format!("a rank below the world size {world}"),
                        rank,
                    ));
                }
                Some(Shard::of(layout.len(), rank, world))
            }
            _ => None,
        };
        // Under ZeRO-1 the weights and gradients are padded to whole shards (reduce-scatter and
        // all-gather move equal pieces); the optimizer state is one shard.
        let len = shard.map_or(layout.len(), |s| s.padded());
        let (lo, hi) = shard.map_or((0, len), |s| s.range());
        let param_arena = Arena::new(len, dtype, device)?;
        let grad_arena = Arena::new(len, dtype, device)?;
        let master_arena = (dtype == DType::BF16)
            .then(|| Arena::new(hi - lo, DType::F32, device))
            .transpose()?;
        let m_arena = Arena::new(hi - lo, DType::F32, device)?;
        let v_arena = Arena::new(hi - lo, DType::F32, device)?;
        let mut init = layout.init(cfg, seed);
        init.resize(len, 0.0);
        glue::upload(&param_arena.whole()?, &init)?;
        if let Some(m) = &master_arena {
            glue::upload(&m.whole()?, &init[lo..hi])?;
        }
        let params = layout.cut(&param_arena)?;
        let grads = layout.cut(&grad_arena)?;
        let mut groups = vec![];
        let mut spans = vec![];
        for (a, b, decay) in [(0, layout.decay_len, true), (layout.decay_len, len, false)] {
            let (a, b) = (a.max(lo), b.min(hi));
            if a >= b {
                continue;
            }
            let n = b - a;
            groups.push([
                Some(param_arena.view(a, &[n])?),
                Some(grad_arena.view(a, &[n])?),
                Some(m_arena.view(a - lo, &[n])?),
                Some(v_arena.view(a - lo, &[n])?),
                master_arena
                    .as_ref()
                    .map(|m| m.view(a - lo, &[n]))
                    .transpose()?,
            ]);
            spans.push((a, n, decay));
        }
        let grads_whole = grad_arena.whole()?;
        let mut model = Model {
            graph: None,
            graph_error: None,
            overlap: None,
            cfg: cfg.clone(),
            dtype,
            device,
            layout,
            opts,
            params,
            grads,
            acts: None,
            groups,
            spans,
            shard,
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
        let len = self.shard.map_or(self.layout.len(), |s| s.padded());
        let a = Arena::new(len, DType::F32, self.device)?;
        // The same ranges as the groups' gradients.
        self.acc_groups = self
            .spans
            .iter()
            .map(|&(off, n, _)| a.view(off, &[n]))
            .collect::<Result<_>>()?;
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

    /// Data parallelism with the all-reduce overlapped with the backward: from now on each layer's
    /// weight gradients are all-reduced over `pg` on a stream of their own as soon as the layer's
    /// backward is done (the rest when the backward ends), inside the step's CUDA graph; the
    /// backward returns with the main stream waiting for them, and [`Model::reduce_grads`] then
    /// only takes the norm. Only on a GPU, without gradient accumulation (the sum must wait for
    /// the last micro-batch) and without ZeRO-1; returns whether it is on. A collective: every
    /// rank calls it.
    pub fn overlap_all_reduce(&mut self, pg: &crate::dist::ProcessGroup) -> Result<bool> {
        if !self.device.is_cuda() || self.acc_whole.is_some() || self.shard.is_some() {
            return Ok(false);
        }
        let gs = pg.gradient_stream(self.device)?;
        let find = |name: &str| -> Result<(usize, usize)> {
            self.layout
                .layout
                .span(name)
                .ok_or_else(|| Error::Other(format!("train: no parameter slot {name}")))
        };
        let g = self._grad_arena.owner();
        let layers = (0..self.cfg.layers)
            .map(|l| {
                let (lo, _) = find(&format!("h{l}.qkv_w"))?;
                let (o, n) = find(&format!("h{l}.fcproj_w"))?;
                g.narrow(0, lo, o + n - lo)
            })
            .collect::<Result<Vec<_>>>()?;
        let first = find("h0.qkv_w")?.0;
        let d = self.layout.decay_len;
        let rest = vec![
            g.narrow(0, 0, first)?,
            g.narrow(0, d, self.layout.len() - d)?,
        ];
        self.graph = None;
        self.overlap = Some(Overlap { gs, layers, rest });
        Ok(true)
    }

    /// The backward of layer `l` is queued: all-reduce its weight gradients on the side stream.
    pub(crate) fn layer_grads_ready(&self, l: usize) -> Result<()> {
        let Some(o) = &self.overlap else {
            return Ok(());
        };
        o.gs.all_reduce_after(&o.layers[l], self.params.wte.cuda_device()?.stream())
    }

    /// The backward is queued: all-reduce the rest, and make the main stream wait for it all.
    pub(crate) fn all_grads_ready(&self) -> Result<()> {
        let Some(o) = &self.overlap else {
            return Ok(());
        };
        let main = self.params.wte.cuda_device()?.stream().clone();
        for t in &o.rest {
            o.gs.all_reduce_after(t, &main)?;
        }
        o.gs.join_into(&main)?;
        self.mark("all-reduce (rest; layers overlapped)")
    }

    /// The step's gradient (accumulated if enabled) made global over the ranks of `pg` — each
    /// rank's backward is scaled by 1/world, so the sum is the mean over the global batch — and
    /// its Σ g² into `sumsq_tensor()`. Data parallel: all-reduced in place (unless the backward
    /// already did it, see [`Model::overlap_all_reduce`]). ZeRO-1: reduce-scattered, each rank
    /// receiving its shard in place, and Σ g² of the shards summed over the ranks, so every rank
    /// clips by the global norm. Without `pg`: the norm only.
    pub fn reduce_grads(&self, pg: Option<&crate::dist::ProcessGroup>) -> Result<()> {
        let a = self.acts()?;
        let g = self.acc_whole.as_ref().unwrap_or(&self.grads_whole);
        match (pg, self.shard) {
            (Some(pg), Some(_)) => {
                let s = self.shard_of(pg, "reduce_grads")?;
                let mine = g.narrow(0, s.range().0, s.len)?;
                pg.reduce_scatter_sum(g, &mine)?;
                self.mark("reduce-scatter")?;
                glue::sumsq(&mine, Some(&a.parts), &a.sumsq)?;
                pg.all_reduce_sum(&a.sumsq)?;
            }
            (Some(pg), None) => {
                if self.overlap.is_none() {
                    pg.all_reduce_sum(g)?;
                    self.mark("all-reduce")?;
                }
                glue::sumsq(g, Some(&a.parts), &a.sumsq)?;
            }
            (None, _) => glue::sumsq(g, Some(&a.parts), &a.sumsq)?,
        }
        self.mark("grad norm")
    }

    /// After the update: under ZeRO-1 every rank's updated shard of the weights gathered into
    /// every rank's full weight buffer; otherwise the replicas are already equal.
    pub fn share_update(&self, pg: Option<&crate::dist::ProcessGroup>) -> Result<()> {
        let (Some(pg), Some(_)) = (pg, self.shard) else {
            return Ok(());
        };
        let s = self.shard_of(pg, "share_update")?;
        let p = self.param_arena.owner();
        pg.all_gather(&p.narrow(0, s.range().0, s.len)?, p)?;
        self.mark("all-gather")
    }

    fn shard_of(&self, pg: &crate::dist::ProcessGroup, op: &str) -> Result<Shard> {
        match self.shard {
            Some(s) if s.rank == pg.rank() && s.world == pg.world() => Ok(s),
            other => Err(Error::bad_arg(
                "train::Model",
                op,
                format!("a model sharded as rank {} of {}", pg.rank(), pg.world()),
                format!("{other:?}"),
            )),
        }
    }

    /// The whole training state as flat buffers of the layout's length: views of this model's
    /// buffers, or under ZeRO-1 the optimizer state gathered from every rank of `pg` into new
    /// buffers (a collective: every rank calls it).
    pub fn flat_state(&self, pg: Option<&crate::dist::ProcessGroup>) -> Result<FlatState> {
        let n = self.layout.len();
        let params = self.param_arena.owner().narrow(0, 0, n)?;
        let own = |a: &Arena| a.owner().narrow(0, 0, n);
        let Some(s) = self.shard else {
            return Ok(FlatState {
                params,
                master: self.master_arena.as_ref().map(own).transpose()?,
                exp_avg: own(&self.m_arena)?,
                exp_avg_sq: own(&self.v_arena)?,
            });
        };
        let pg = pg.ok_or_else(|| {
            Error::Other("train: a ZeRO-1 model's state is gathered over its process group".into())
        })?;
        self.shard_of(pg, "flat_state")?;
        let gather = |a: &Arena| -> Result<Tensor> {
            let full = Tensor::empty(&[s.padded()], DType::F32, self.device)?;
            pg.all_gather(&a.owner().narrow(0, 0, s.len)?, &full)?;
            full.narrow(0, 0, n)
        };
        Ok(FlatState {
            params,
            master: self.master_arena.as_ref().map(gather).transpose()?,
            exp_avg: gather(&self.m_arena)?,
            exp_avg_sq: gather(&self.v_arena)?,
        })
    }

    /// ZeRO-1's shard of this model, if sharded.
    pub fn shard(&self) -> Option<Shard> {
        self.shard
    }

    /// One AdamW step over both groups (weight decay on the first only).
    pub fn optimizer_step(&self, hp: &AdamWHyper) -> Result<()> {
        let wd = |i: usize| {
            if self.spans[i].2 {
                hp.weight_decay
            } else {
                0.0
            }
        };
        let acc = self.acc_whole.is_some();
        if self.device.is_cuda() {
            let plans = if acc { &self.acc_plans } else { &self.plans };
            for (i, plan) in plans.iter().enumerate() {
                plan.step(
                    &AdamWHyper {
                        weight_decay: wd(i),
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
                    weight_decay: wd(i),
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
    /// The gradients' sum of squares from [`Model::reduce_grads`] (f32, one element, on the device).
    pub fn sumsq_tensor(&self) -> Result<&Tensor> {
        Ok(&self.acts()?.sumsq)
    }
    /// The logits `[B·T, vocab]` (a view of the padded buffer) after a forward without
    /// gradient.
    pub fn logits(&self) -> Result<Tensor> {
        self.acts()?.logits.narrow(1, 0, self.cfg.vocab)
    }
    /// The flat parameter buffer (checkpoints, tests); under ZeRO-1 padded to whole shards.
    pub fn param_buffer(&self) -> &Tensor {
        self.param_arena.owner()
    }
    /// The flat f32 master weights (bf16 models) and AdamW moments: under ZeRO-1 this model's
    /// shard of them (see [`Model::flat_state`] for the whole).
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
