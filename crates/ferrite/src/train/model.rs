//! GPT-2 with explicit forward and backward calls into ferrite's op families — no autograd.
//!
//! Per block (pre-norm): h = x + proj(attn(ln1(x))), y = h + fc2(gelu(fc1(ln2(h)))). The residual
//! adds ride in the projections' GEMM epilogues; fc1's bias and GELU in its epilogue (keeping the
//! pre-activation for the backward); the backward's GELU' and fc1's bias gradient in fc2's dX GEMM
//! (the linear family's chain form); the classifier is the tied embedding, and cross-entropy
//! overwrites the logits with their gradient, already scaled, in one pass.

use super::arena::{Arena, Layout};
use super::config::ModelConfig;
use super::glue;
use crate::core::cuda::GpuTimer;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::ops::adamw::{self, cuda::AdamWPlan, AdamWHyper, AdamWOptions, AdamWTensor};
use crate::ops::attention::{self, AttentionOptions};
use crate::ops::cross_entropy::{self, CrossEntropyOptions, GradOut, Reduction};
use crate::ops::linear::{self, LinearOptions};
use crate::ops::matmul::epilogue::Activation;
use crate::ops::norm::{self, NormKind, NormOptions};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

const EPS: f32 = 1e-5;

/// One block's parameters (or gradients): views into an arena.
pub struct Block {
    pub ln1_w: Tensor,
    pub ln1_b: Tensor,
    pub qkv_w: Tensor,
    pub qkv_b: Tensor,
    pub proj_w: Tensor,
    pub proj_b: Tensor,
    pub ln2_w: Tensor,
    pub ln2_b: Tensor,
    pub fc_w: Tensor,
    pub fc_b: Tensor,
    pub fcproj_w: Tensor,
    pub fcproj_b: Tensor,
}

/// Every parameter (or gradient) tensor of the model, as views into one arena.
pub struct Params {
    pub wte: Tensor,
    pub wpe: Tensor,
    pub lnf_w: Tensor,
    pub lnf_b: Tensor,
    pub blocks: Vec<Block>,
}

/// Where each parameter lives in the flat buffers: the weight-decayed group (matrices and
/// embeddings) first, then the rest (biases, norm gains).
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub layout: Layout,
    /// Elements [0, decay_len) are decayed, [decay_len, len) are not.
    pub decay_len: usize,
}

impl ParamLayout {
    pub fn new(cfg: &ModelConfig) -> ParamLayout {
        let (c, v, p) = (cfg.dim, cfg.padded_vocab(), cfg.max_seq);
        let mut l = Layout::default();
        l.push("wte", &[v, c]);
        l.push("wpe", &[p, c]);
        for i in 0..cfg.layers {
            l.push(format!("h{i}.qkv_w"), &[3 * c, c]);
            l.push(format!("h{i}.proj_w"), &[c, c]);
            l.push(format!("h{i}.fc_w"), &[4 * c, c]);
            l.push(format!("h{i}.fcproj_w"), &[c, 4 * c]);
        }
        l.align();
        let decay_len = l.len;
        l.push("lnf_w", &[c]);
        l.push("lnf_b", &[c]);
        for i in 0..cfg.layers {
            l.push(format!("h{i}.ln1_w"), &[c]);
            l.push(format!("h{i}.ln1_b"), &[c]);
            l.push(format!("h{i}.qkv_b"), &[3 * c]);
            l.push(format!("h{i}.proj_b"), &[c]);
            l.push(format!("h{i}.ln2_w"), &[c]);
            l.push(format!("h{i}.ln2_b"), &[c]);
            l.push(format!("h{i}.fc_b"), &[4 * c]);
            l.push(format!("h{i}.fcproj_b"), &[c]);
        }
        l.align();
        ParamLayout {
            layout: l,
            decay_len,
        }
    }

    pub fn len(&self) -> usize {
        self.layout.len
    }
    pub fn is_empty(&self) -> bool {
        self.layout.len == 0
    }

    /// GPT-2's initialisation (as llm.c and Hugging Face): weights N(0, 0.02), the two residual
    /// projections N(0, 0.02/√(2L)), biases 0, norm gains 1. Padding stays 0.
    pub fn init(&self, cfg: &ModelConfig, seed: u64) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        let mut rng = Rng::new(seed);
        let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        for (name, off, shape) in &self.layout.slots {
            let n: usize = shape.iter().product();
            let dst = &mut out[*off..off + n];
            let base = name.rsplit('.').next().unwrap_or(name);
            match base {
                "ln1_w" | "ln2_w" | "lnf_w" => dst.fill(1.0),
                // the padded vocabulary rows stay zero
                "wte" => fill_normal(&mut dst[..cfg.vocab * cfg.dim], 0.02, &mut rng),
                b if b.ends_with("_b") => {}
                b => {
                    let std = if b == "proj_w" || b == "fcproj_w" {
                        proj_std
                    } else {
                        0.02
                    };
                    fill_normal(dst, std, &mut rng);
                }
            }
        }
        out
    }

    fn cut(&self, arena: &Arena) -> Result<Params> {
        let map: HashMap<&str, (usize, &[usize])> = self
            .layout
            .slots
            .iter()
            .map(|(n, o, s)| (n.as_str(), (*o, s.as_slice())))
            .collect();
        let get = |name: &str| -> Result<Tensor> {
            let (o, s) = map[name];
            arena.view(o, s)
        };
        let layers = self
            .layout
            .slots
            .iter()
            .filter(|s| s.0.ends_with(".qkv_w"))
            .count();
        let mut blocks = Vec::with_capacity(layers);
        for i in 0..layers {
            let g = |s: &str| get(&format!("h{i}.{s}"));
            blocks.push(Block {
                ln1_w: g("ln1_w")?,
                ln1_b: g("ln1_b")?,
                qkv_w: g("qkv_w")?,
                qkv_b: g("qkv_b")?,
                proj_w: g("proj_w")?,
                proj_b: g("proj_b")?,
                ln2_w: g("ln2_w")?,
                ln2_b: g("ln2_b")?,
                fc_w: g("fc_w")?,
                fc_b: g("fc_b")?,
                fcproj_w: g("fcproj_w")?,
                fcproj_b: g("fcproj_b")?,
            });
        }
        Ok(Params {
            wte: get("wte")?,
            wpe: get("wpe")?,
            lnf_w: get("lnf_w")?,
            lnf_b: get("lnf_b")?,
            blocks,
        })
    }
}

/// Box–Muller normals, two per pair of uniforms.
fn fill_normal(dst: &mut [f32], std: f64, rng: &mut Rng) {
    let mut i = 0;
    while i < dst.len() {
        let u1 = rng.next_f64().max(1e-300);
        let u2 = rng.next_f64();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let t = 2.0 * std::f64::consts::PI * u2;
        dst[i] = (r * t.cos()) as f32;
        if i + 1 < dst.len() {
            dst[i + 1] = (r * t.sin()) as f32;
        }
        i += 2;
    }
}

/// Saved forward state of one block (what its backward reads).
struct BlockActs {
    ln1: Tensor,
    ln1_mean: Tensor,
    ln1_rstd: Tensor,
    qkv: Tensor,
    att: Tensor,
    lse: Tensor,
    mid: Tensor,
    ln2: Tensor,
    ln2_mean: Tensor,
    ln2_rstd: Tensor,
    fch_pre: Tensor,
    fch: Tensor,
}

/// Activations and scratch for one (B, T).
struct Acts {
    batch: usize,
    seq: usize,
    tokens: Tensor,
    inputs: Tensor,
    targets: Tensor,
    /// res[l]: the residual stream entering block l; res[L] leaves the last block.
    res: Vec<Tensor>,
    blocks: Vec<BlockActs>,
    lnf: Tensor,
    lnf_mean: Tensor,
    lnf_rstd: Tensor,
    logits: Tensor,
    loss_rows: Tensor,
    // backward scratch
    dres: Tensor,
    dtmp: Tensor,
    dln: Tensor,
    datt: Tensor,
    dfch: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dqkv: Tensor,
    keys: Tensor,
    parts: Tensor,
    /// scalars: [0] the micro-batch loss, [16] the gradient's Σ g².
    loss: Tensor,
    sumsq: Tensor,
    // views above borrow these: declared last, dropped last
    _dqkv_arena: Arena,
    _scalars: Arena,
}

impl Acts {
    fn new(cfg: &ModelConfig, b: usize, t: usize, dtype: DType, dev: Device) -> Result<Acts> {
        let (c, h, d, v) = (cfg.dim, cfg.heads, cfg.head_dim(), cfg.padded_vocab());
        let n = b * t;
        let e = |shape: &[usize]| Tensor::empty(shape, dtype, dev);
        let f = |shape: &[usize]| Tensor::empty(shape, DType::F32, dev);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            blocks.push(BlockActs {
                ln1: e(&[n, c])?,
                ln1_mean: f(&[n])?,
                ln1_rstd: f(&[n])?,
                qkv: e(&[n, 3 * c])?,
                att: e(&[n, c])?,
                lse: f(&[b, h, t])?,
                mid: e(&[n, c])?,
                ln2: e(&[n, c])?,
                ln2_mean: f(&[n])?,
                ln2_rstd: f(&[n])?,
                fch_pre: e(&[n, 4 * c])?,
                fch: e(&[n, 4 * c])?,
            });
        }
        let dqkv_arena = Arena::new(n * 3 * c, dtype, dev)?;
        let qkv_strides = [t * 3 * c, 3 * c, d, 1];
        let dview = |i: usize| dqkv_arena.view_strided(i * c, &[b, t, h, d], &qkv_strides);
        let scalars = Arena::new(32, DType::F32, dev)?;
        Ok(Acts {
            batch: b,
            seq: t,
            tokens: Tensor::empty(&[b, t + 1], DType::I32, dev)?,
            inputs: Tensor::empty(&[n], DType::I32, dev)?,
            targets: Tensor::empty(&[n], DType::I32, dev)?,
            res: (0..=cfg.layers)
                .map(|_| e(&[n, c]))
                .collect::<Result<_>>()?,
            blocks,
            lnf: e(&[n, c])?,
            lnf_mean: f(&[n])?,
            lnf_rstd: f(&[n])?,
            logits: e(&[n, v])?,
            loss_rows: f(&[n])?,
            dres: e(&[n, c])?,
            dtmp: e(&[n, c])?,
            dln: e(&[n, c])?,
            datt: e(&[n, c])?,
            dfch: e(&[n, 4 * c])?,
            dq: dview(0)?,
            dk: dview(1)?,
            dv: dview(2)?,
            dqkv: dqkv_arena.view(0, &[n, 3 * c])?,
            keys: Tensor::empty(&[2 * glue::SORT_N], DType::I32, dev)?,
            parts: f(&[glue::SUMSQ_PARTS])?,
            loss: scalars.view(0, &[1])?,
            sumsq: scalars.view(16, &[1])?,
            _dqkv_arena: dqkv_arena,
            _scalars: scalars,
        })
    }
}

struct Mark {
    label: &'static str,
    event: Option<GpuTimer>,
    host: Instant,
}

/// One line of a step's profile.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileRow {
    pub label: String,
    pub calls: usize,
    pub gpu_ms: f64,
    pub host_ms: f64,
}

/// Options of the model's op calls.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Attention backward without atomics (same bits every run).
    pub deterministic: bool,
}

/// The model: parameters, gradients, AdamW state and activations for one (B, T).
pub struct Gpt2 {
    /// The captured forward + backward (CUDA), replayed by `train_step`; dropped first.
    graph: Option<(cudarc::driver::CudaGraph, f32)>,
    graph_error: Option<String>,
    pub cfg: ModelConfig,
    pub dtype: DType,
    pub device: Device,
    pub layout: ParamLayout,
    opts: ModelOptions,
    pub params: Params,
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

impl Gpt2 {
    /// A freshly initialised model (`seed`) in `dtype` (f32 or bf16; bf16 keeps f32 master
    /// weights for AdamW) on `device`.
    pub fn new(
        cfg: &ModelConfig,
        dtype: DType,
        device: Device,
        seed: u64,
        opts: ModelOptions,
    ) -> Result<Gpt2> {
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
        let mut model = Gpt2 {
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
        self.acts = Some(Acts::new(&self.cfg, batch, seq, self.dtype, self.device)?);
        Ok(())
    }

    /// Bytes the model needs for (B, T): parameters, gradients, AdamW state, activations.
    pub fn estimate_bytes(
        cfg: &ModelConfig,
        dtype: DType,
        batch: usize,
        seq: usize,
        accumulate: bool,
    ) -> u64 {
        let es = dtype.size_in_bytes() as u64;
        let p = ParamLayout::new(cfg).len() as u64;
        let master = if dtype == DType::BF16 { 4 } else { 0 };
        let state = p * (2 * es + 8 + master + if accumulate { 4 } else { 0 });
        let (n, c, l) = ((batch * seq) as u64, cfg.dim as u64, cfg.layers as u64);
        let per_layer = n * c * es * 16 + n * 4 * 4 + (batch * cfg.heads * seq) as u64 * 4;
        let acts =
            l * per_layer + (l + 1) * n * c * es + n * cfg.vocab as u64 * es + n * c * es * 12;
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

    fn acts(&self) -> Result<&Acts> {
        self.acts
            .as_ref()
            .ok_or_else(|| Error::Other("train: model.prepare(batch, seq) was not called".into()))
    }

    /// Forward over the loaded tokens; with `dloss` the logits are overwritten by the loss's
    /// gradient scaled by dloss (training), else kept. The mean loss lands in `loss_tensor()`.
    pub fn forward(&self, dloss: Option<f32>) -> Result<()> {
        let a = self.acts()?;
        let cfg = &self.cfg;
        let (b, t, c, h, d) = (a.batch, a.seq, cfg.dim, cfg.heads, cfg.head_dim());
        let p = &self.params;
        glue::embed_forward(&a.inputs, &p.wte, Some(&p.wpe), &a.res[0], t, cfg.vocab)?;
        self.mark("embed")?;
        let nopts = NormOptions {
            eps: EPS,
            ..Default::default()
        };
        let lin = LinearOptions::default();
        let gelu = LinearOptions {
            activation: Activation::GeluTanh,
            ..Default::default()
        };
        let aopts = AttentionOptions {
            causal: true,
            deterministic: self.opts.deterministic,
            ..Default::default()
        };
        let qkv_strides = [t * 3 * c, 3 * c, d, 1];
        for (l, (w, s)) in p.blocks.iter().zip(&a.blocks).enumerate() {
            let x = &a.res[l];
            layer_norm(
                x,
                &w.ln1_w,
                &w.ln1_b,
                &s.ln1,
                &s.ln1_mean,
                &s.ln1_rstd,
                &nopts,
            )?;
            self.mark("layernorm")?;
            linear_fwd(&s.ln1, &w.qkv_w, Some(&w.qkv_b), None, &s.qkv, None, &lin)?;
            self.mark("qkv")?;
            let base = s.qkv.layout().offset();
            let qv = |i: usize| s.qkv.as_strided(&[b, t, h, d], &qkv_strides, base + i * c);
            let o = s.att.reshape(&[b, t, h, d])?;
            attention::attention_forward_into(&qv(0)?, &qv(1)?, &qv(2)?, &o, &s.lse, None, &aopts)?;
            self.mark("attention")?;
            linear_fwd(
                &s.att,
                &w.proj_w,
                Some(&w.proj_b),
                Some(x),
                &s.mid,
                None,
                &lin,
            )?;
            self.mark("proj (+ residual)")?;
            layer_norm(
                &s.mid,
                &w.ln2_w,
                &w.ln2_b,
                &s.ln2,
                &s.ln2_mean,
                &s.ln2_rstd,
                &nopts,
            )?;
            self.mark("layernorm")?;
            linear_fwd(
                &s.ln2,
                &w.fc_w,
                Some(&w.fc_b),
                None,
                &s.fch,
                Some(&s.fch_pre),
                &gelu,
            )?;
            self.mark("fc (+ bias, GELU)")?;
            linear_fwd(
                &s.fch,
                &w.fcproj_w,
                Some(&w.fcproj_b),
                Some(&s.mid),
                &a.res[l + 1],
                None,
                &lin,
            )?;
            self.mark("fcproj (+ residual)")?;
        }
        let last = &a.res[cfg.layers];
        layer_norm(
            last,
            &p.lnf_w,
            &p.lnf_b,
            &a.lnf,
            &a.lnf_mean,
            &a.lnf_rstd,
            &nopts,
        )?;
        self.mark("layernorm")?;
        linear_fwd(&a.lnf, &p.wte, None, None, &a.logits, None, &lin)?;
        self.mark("classifier")?;
        let ce = CrossEntropyOptions {
            reduction: Reduction::Mean,
            dloss: dloss.unwrap_or(1.0),
            check_targets: false,
            ..Default::default()
        };
        let grad = if dloss.is_some() {
            GradOut::InPlace
        } else {
            GradOut::Skip
        };
        cross_entropy::cross_entropy_into(
            &a.logits.narrow(1, 0, cfg.vocab)?,
            &a.targets,
            &a.loss_rows,
            Some(&a.loss),
            grad,
            &ce,
        )?;
        self.mark("cross_entropy")
    }

    /// Backward after a training forward: every gradient written (overwritten) in `grads`.
    pub fn backward(&self) -> Result<()> {
        let a = self.acts()?;
        let cfg = &self.cfg;
        let (b, t, c, h, d) = (a.batch, a.seq, cfg.dim, cfg.heads, cfg.head_dim());
        let (p, g) = (&self.params, &self.grads);
        let lin = LinearOptions::default();
        let aopts = AttentionOptions {
            causal: true,
            deterministic: self.opts.deterministic,
            ..Default::default()
        };
        // classifier (tied): dlnf = dlogits·wte, dwte = dlogitsᵀ·lnf (overwrites dwte)
        linear_bwd(
            &a.logits,
            &a.lnf,
            &p.wte,
            None,
            Some(&a.dln),
            Some(&g.wte),
            None,
            None,
            &lin,
        )?;
        self.mark("classifier.bwd")?;
        layer_norm_bwd(
            &a.dln,
            &a.res[cfg.layers],
            &p.lnf_w,
            &a.lnf_mean,
            &a.lnf_rstd,
            &a.dres,
            &g.lnf_w,
            &g.lnf_b,
        )?;
        self.mark("layernorm.bwd")?;
        let qkv_strides = [t * 3 * c, 3 * c, d, 1];
        for l in (0..cfg.layers).rev() {
            let (w, gw, s) = (&p.blocks[l], &g.blocks[l], &a.blocks[l]);
            // MLP: fc2's dX GEMM applies GELU' and sums fc1's bias gradient (chain form)
            linear::backward_into(
                &linear::Bwd {
                    dy: &a.dres,
                    x: &s.fch,
                    w: &w.fcproj_w,
                    z: None,
                    x_pre: Some((&s.fch_pre, Activation::GeluTanh)),
                },
                &linear::BwdOut {
                    dx: Some(&a.dfch),
                    dw: Some(&gw.fcproj_w),
                    db: Some(&gw.fcproj_b),
                    db_pre: Some(&gw.fc_b),
                },
                &lin,
            )?;
            self.mark("fcproj.bwd (GELU' + fc bias in the epilogue)")?;
            linear_bwd(
                &a.dfch,
                &s.ln2,
                &w.fc_w,
                None,
                Some(&a.dln),
                Some(&gw.fc_w),
                None,
                None,
                &lin,
            )?;
            self.mark("fc.bwd")?;
            layer_norm_bwd(
                &a.dln,
                &s.mid,
                &w.ln2_w,
                &s.ln2_mean,
                &s.ln2_rstd,
                &a.dtmp,
                &gw.ln2_w,
                &gw.ln2_b,
            )?;
            self.mark("layernorm.bwd")?;
            glue::add_inplace(&a.dres, &a.dtmp)?;
            self.mark("residual add")?;
            // attention
            linear_bwd(
                &a.dres,
                &s.att,
                &w.proj_w,
                None,
                Some(&a.datt),
                Some(&gw.proj_w),
                Some(&gw.proj_b),
                None,
                &lin,
            )?;
            self.mark("proj.bwd")?;
            let base = s.qkv.layout().offset();
            let qv = |i: usize| s.qkv.as_strided(&[b, t, h, d], &qkv_strides, base + i * c);
            attention::attention_backward_into(
                &a.datt.reshape(&[b, t, h, d])?,
                &qv(0)?,
                &qv(1)?,
                &qv(2)?,
                &s.att.reshape(&[b, t, h, d])?,
                &s.lse,
                &a.dq,
                &a.dk,
                &a.dv,
                None,
                &aopts,
            )?;
            self.mark("attention.bwd")?;
            linear_bwd(
                &a.dqkv,
                &s.ln1,
                &w.qkv_w,
                None,
                Some(&a.dln),
                Some(&gw.qkv_w),
                Some(&gw.qkv_b),
                None,
                &lin,
            )?;
            self.mark("qkv.bwd")?;
            layer_norm_bwd(
                &a.dln,
                &a.res[l],
                &w.ln1_w,
                &s.ln1_mean,
                &s.ln1_rstd,
                &a.dtmp,
                &gw.ln1_w,
                &gw.ln1_b,
            )?;
            self.mark("layernorm.bwd")?;
            glue::add_inplace(&a.dres, &a.dtmp)?;
            self.mark("residual add")?;
        }
        glue::embed_backward(
            &a.inputs,
            &a.dres,
            &g.wte,
            Some(&g.wpe),
            t,
            cfg.vocab,
            Some(&a.keys),
        )?;
        self.mark("embed.bwd")
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

    fn mark(&self, label: &'static str) -> Result<()> {
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

    pub fn loss_tensor(&self) -> Result<&Tensor> {
        Ok(&self.acts()?.loss)
    }
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

#[allow(clippy::too_many_arguments)]
fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    y: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    o: &NormOptions,
) -> Result<()> {
    norm::forward_into(
        NormKind::Layer,
        &norm::Fwd {
            x,
            residual: None,
            weight: Some(w),
            bias: Some(bias),
        },
        &norm::FwdOut {
            y,
            h: None,
            mean: Some(mean),
            rstd: Some(rstd),
        },
        o,
    )
}

#[allow(clippy::too_many_arguments)]
fn layer_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dx: &Tensor,
    dw: &Tensor,
    db: &Tensor,
) -> Result<()> {
    norm::backward_into(
        NormKind::Layer,
        &norm::Bwd {
            dy,
            x,
            weight: Some(w),
            mean: Some(mean),
            rstd,
        },
        &norm::BwdOut {
            dx,
            dweight: Some(dw),
            dbias: Some(db),
        },
        &NormOptions {
            eps: EPS,
            ..Default::default()
        },
    )
}

fn linear_fwd(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    y: &Tensor,
    z: Option<&Tensor>,
    o: &LinearOptions,
) -> Result<()> {
    linear::forward_into(
        &linear::Fwd {
            x,
            w,
            bias,
            residual,
        },
        &linear::FwdOut { y, z },
        o,
    )
}

#[allow(clippy::too_many_arguments)]
fn linear_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    z: Option<&Tensor>,
    dx: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
    db_pre: Option<&Tensor>,
    o: &LinearOptions,
) -> Result<()> {
    linear::backward_into(
        &linear::Bwd {
            dy,
            x,
            w,
            z,
            x_pre: None,
        },
        &linear::BwdOut { dx, dw, db, db_pre },
        o,
    )
}
