//! The two decoder families as explicit forward and backward calls into ferrite's op families.
//!
//! GPT-2 (pre-norm): h = x + proj(attn(ln1(x))), y = h + fc2(gelu(fc1(ln2(h)))). The residual adds
//! ride in the projections' GEMM epilogues; fc1's bias and GELU in its epilogue (keeping the
//! pre-activation); the backward's GELU' and fc1's bias gradient in fc2's dX GEMM (the linear
//! family's chain form); the classifier is the tied embedding.
//!
//! Llama: h = x + o(attn(rope(q), rope(k), v)) with q, k, v from one GEMM over rms1(x) and grouped
//! key/value heads; y = h + down(silu(gate) ⊙ up) with gate and up from one GEMM over rms2(h);
//! rotary embeddings applied in place on the QKV buffer (and their inverse on the gradient); an
//! untied classifier; no biases.
//!
//! Both: cross-entropy overwrites the logits with their gradient, already scaled, in one pass.

use super::arena::{Arena, Layout};
use super::config::{Family, ModelConfig};
use super::glue;
use super::model::Model;
use crate::core::act::Activation;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::ops::activation::{self, GluOptions};
use crate::ops::attention::{self, AttentionOptions};
use crate::ops::cross_entropy::{self, CrossEntropyOptions, GradOut, Reduction};
use crate::ops::linear::{self, LinearOptions};
use crate::ops::norm::{self, NormKind, NormOptions};
use std::collections::HashMap;

pub(crate) const EPS: f32 = 1e-5;

/// One block's parameters (or gradients): views into an arena. Biases are GPT-2's only.
pub struct Block {
    /// The attention's norm gain `[dim]`.
    pub ln1_w: Tensor,
    /// The attention norm's bias (GPT-2's LayerNorm).
    pub ln1_b: Option<Tensor>,
    /// The fused QKV projection `[(heads + 2·kv_heads)·head_dim, dim]`.
    pub qkv_w: Tensor,
    /// The QKV projection's bias (GPT-2).
    pub qkv_b: Option<Tensor>,
    /// The attention's output projection `[dim, heads·head_dim]`.
    pub proj_w: Tensor,
    /// The output projection's bias (GPT-2).
    pub proj_b: Option<Tensor>,
    /// The MLP's norm gain `[dim]`.
    pub ln2_w: Tensor,
    /// The MLP norm's bias (GPT-2).
    pub ln2_b: Option<Tensor>,
    /// GPT-2: fc1 `[ffn, dim]`; Llama: gate and up stacked, `[2·ffn, dim]`.
    pub fc_w: Tensor,
    /// fc1's bias (GPT-2).
    pub fc_b: Option<Tensor>,
    /// The MLP's down projection `[dim, ffn]`.
    pub fcproj_w: Tensor,
    /// The down projection's bias (GPT-2).
    pub fcproj_b: Option<Tensor>,
}

/// Every parameter (or gradient) tensor of the model, as views into one arena.
pub struct Params {
    /// The token embedding `[padded_vocab, dim]`.
    pub wte: Tensor,
    /// GPT-2's learned positions.
    pub wpe: Option<Tensor>,
    /// The final norm's gain `[dim]`.
    pub lnf_w: Tensor,
    /// The final norm's bias (GPT-2).
    pub lnf_b: Option<Tensor>,
    /// Llama's untied classifier (GPT-2 uses `wte`).
    pub head: Option<Tensor>,
    /// The transformer blocks, bottom first.
    pub blocks: Vec<Block>,
}

impl Params {
    /// The classifier's weight.
    pub fn classifier(&self) -> &Tensor {
        self.head.as_ref().unwrap_or(&self.wte)
    }
}

/// Where each parameter lives in the flat buffers: the weight-decayed group (matrices and
/// embeddings) first, then the rest (biases, norm gains).
#[derive(Clone, Debug)]
pub struct ParamLayout {
    /// The named slots.
    pub layout: Layout,
    /// Elements [0, decay_len) are decayed, [decay_len, len) are not.
    pub decay_len: usize,
}

impl ParamLayout {
    /// The slots of `cfg`'s parameters.
    pub fn new(cfg: &ModelConfig) -> ParamLayout {
        let (c, v, f, w) = (cfg.dim, cfg.padded_vocab(), cfg.ffn, cfg.qkv_width());
        let gpt2 = cfg.family == Family::Gpt2;
        let mut l = Layout::default();
        l.push("wte", &[v, c]);
        if gpt2 {
            l.push("wpe", &[cfg.max_seq, c]);
        } else {
            l.push("head", &[v, c]);
        }
        for i in 0..cfg.layers {
            l.push(format!("h{i}.qkv_w"), &[w, c]);
            l.push(format!("h{i}.proj_w"), &[c, cfg.heads * cfg.head_dim()]);
            l.push(format!("h{i}.fc_w"), &[cfg.up_width(), c]);
            l.push(format!("h{i}.fcproj_w"), &[c, f]);
        }
        l.align();
        let decay_len = l.len;
        l.push("lnf_w", &[c]);
        if gpt2 {
            l.push("lnf_b", &[c]);
        }
        for i in 0..cfg.layers {
            l.push(format!("h{i}.ln1_w"), &[c]);
            l.push(format!("h{i}.ln2_w"), &[c]);
            if gpt2 {
                l.push(format!("h{i}.ln1_b"), &[c]);
                l.push(format!("h{i}.qkv_b"), &[w]);
                l.push(format!("h{i}.proj_b"), &[c]);
                l.push(format!("h{i}.ln2_b"), &[c]);
                l.push(format!("h{i}.fc_b"), &[f]);
                l.push(format!("h{i}.fcproj_b"), &[c]);
            }
        }
        l.align();
        ParamLayout {
            layout: l,
            decay_len,
        }
    }

    /// Elements of the flat buffer.
    pub fn len(&self) -> usize {
        self.layout.len
    }
    /// Whether the layout holds nothing.
    pub fn is_empty(&self) -> bool {
        self.layout.len == 0
    }

    /// GPT-2's initialisation (as llm.c and Hugging Face; Llama trains from the same): weights
    /// N(0, 0.02), the two residual projections N(0, 0.02/√(2L)), biases 0, norm gains 1. The
    /// vocabulary's padding rows and the alignment padding stay 0.
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
                "wte" | "head" => fill_normal(&mut dst[..cfg.vocab * cfg.dim], 0.02, &mut rng),
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

    pub(crate) fn cut(&self, arena: &Arena) -> Result<Params> {
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
        let opt = |name: &str| -> Result<Option<Tensor>> {
            map.get(name).map(|&(o, s)| arena.view(o, s)).transpose()
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
            let o = |s: &str| opt(&format!("h{i}.{s}"));
            blocks.push(Block {
                ln1_w: g("ln1_w")?,
                ln1_b: o("ln1_b")?,
                qkv_w: g("qkv_w")?,
                qkv_b: o("qkv_b")?,
                proj_w: g("proj_w")?,
                proj_b: o("proj_b")?,
                ln2_w: g("ln2_w")?,
                ln2_b: o("ln2_b")?,
                fc_w: g("fc_w")?,
                fc_b: o("fc_b")?,
                fcproj_w: g("fcproj_w")?,
                fcproj_b: o("fcproj_b")?,
            });
        }
        Ok(Params {
            wte: get("wte")?,
            wpe: opt("wpe")?,
            lnf_w: get("lnf_w")?,
            lnf_b: opt("lnf_b")?,
            head: opt("head")?,
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
pub(crate) struct BlockActs {
    ln1: Tensor,
    ln1_mean: Tensor,
    ln1_rstd: Tensor,
    /// `[B·T, qkv_width]`: q, k (rotated, for Llama), v.
    qkv: Tensor,
    att: Tensor,
    lse: Tensor,
    mid: Tensor,
    ln2: Tensor,
    ln2_mean: Tensor,
    ln2_rstd: Tensor,
    /// The MLP's first GEMM output: GPT-2's pre-activation `[N, ffn]`, Llama's [gate, up] `[N, 2·ffn]`.
    fch_pre: Tensor,
    /// The MLP's hidden activation `[N, ffn]`.
    fch: Tensor,
}

/// Activations and scratch for one (B, T).
pub(crate) struct Acts {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) tokens: Tensor,
    pub(crate) inputs: Tensor,
    pub(crate) targets: Tensor,
    /// res[l]: the residual stream entering block l; res[L] leaves the last block.
    res: Vec<Tensor>,
    blocks: Vec<BlockActs>,
    lnf: Tensor,
    lnf_mean: Tensor,
    lnf_rstd: Tensor,
    pub(crate) logits: Tensor,
    loss_rows: Tensor,
    // backward scratch
    dres: Tensor,
    dtmp: Tensor,
    dln: Tensor,
    datt: Tensor,
    /// d(MLP hidden) `[N, ffn]` (GPT-2: dZ of fc1, from the chain form).
    dfch: Tensor,
    /// Llama: d[gate, up] `[N, 2·ffn]`.
    dpre: Option<Tensor>,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dqkv: Tensor,
    keys: Tensor,
    pub(crate) parts: Tensor,
    /// scalars: [0] the micro-batch loss, [16] the gradient's Σ g².
    pub(crate) loss: Tensor,
    pub(crate) sumsq: Tensor,
    // views above borrow these: declared last, dropped last
    _dqkv_arena: Arena,
    _scalars: Arena,
}

/// The `[B, T, heads, D]` views of q, k and v in a `[B·T, qkv_width]` buffer.
fn qkv_views(
    cfg: &ModelConfig,
    b: usize,
    t: usize,
    view: impl Fn(usize, &[usize], &[usize]) -> Result<Tensor>,
) -> Result<[Tensor; 3]> {
    let (d, hq, hk) = (cfg.head_dim(), cfg.heads, cfg.kv_heads);
    let w = cfg.qkv_width();
    let st = [t * w, w, d, 1];
    Ok([
        view(0, &[b, t, hq, d], &st)?,
        view(hq * d, &[b, t, hk, d], &st)?,
        view((hq + hk) * d, &[b, t, hk, d], &st)?,
    ])
}

impl Acts {
    pub(crate) fn new(
        cfg: &ModelConfig,
        b: usize,
        t: usize,
        dtype: DType,
        dev: Device,
        recompute: bool,
    ) -> Result<Acts> {
        let (c, v, f, w) = (cfg.dim, cfg.padded_vocab(), cfg.ffn, cfg.qkv_width());
        let n = b * t;
        let e = |shape: &[usize]| Tensor::empty(shape, dtype, dev);
        let fl = |shape: &[usize]| Tensor::empty(shape, DType::F32, dev);
        // With recompute, every layer's norm outputs and MLP hidden share one buffer each (clones
        // of one tensor); the backward recomputes them layer by layer.
        let shared = recompute
            .then(|| -> Result<_> { Ok((e(&[n, c])?, e(&[n, c])?, e(&[n, f])?)) })
            .transpose()?;
        let own = |i: usize, shape: &[usize]| -> Result<Tensor> {
            match &shared {
                Some(sh) => Ok([&sh.0, &sh.1, &sh.2][i].clone()),
                None => e(shape),
            }
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            blocks.push(BlockActs {
                ln1: own(0, &[n, c])?,
                ln1_mean: fl(&[n])?,
                ln1_rstd: fl(&[n])?,
                qkv: e(&[n, w])?,
                att: e(&[n, c])?,
                lse: fl(&[b, cfg.heads, t])?,
                mid: e(&[n, c])?,
                ln2: own(1, &[n, c])?,
                ln2_mean: fl(&[n])?,
                ln2_rstd: fl(&[n])?,
                fch_pre: e(&[n, cfg.up_width()])?,
                fch: own(2, &[n, f])?,
            });
        }
        let dqkv_arena = Arena::new(n * w, dtype, dev)?;
        let [dq, dk, dv] = qkv_views(cfg, b, t, |o, s, st| dqkv_arena.view_strided(o, s, st))?;
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
            lnf_mean: fl(&[n])?,
            lnf_rstd: fl(&[n])?,
            logits: e(&[n, v])?,
            loss_rows: fl(&[n])?,
            dres: e(&[n, c])?,
            dtmp: e(&[n, c])?,
            dln: e(&[n, c])?,
            datt: e(&[n, c])?,
            dfch: e(&[n, f])?,
            dpre: (cfg.family == Family::Llama)
                .then(|| e(&[n, 2 * f]))
                .transpose()?,
            dq,
            dk,
            dv,
            dqkv: dqkv_arena.view(0, &[n, w])?,
            keys: Tensor::empty(&[2 * glue::SORT_N], DType::I32, dev)?,
            parts: fl(&[glue::SUMSQ_PARTS])?,
            loss: scalars.view(0, &[1])?,
            sumsq: scalars.view(16, &[1])?,
            _dqkv_arena: dqkv_arena,
            _scalars: scalars,
        })
    }
}

/// A norm of the model's family: LayerNorm with bias (mean kept) or RMSNorm.
pub(crate) struct Norm<'a> {
    kind: NormKind,
    w: &'a Tensor,
    b: Option<&'a Tensor>,
}

impl Norm<'_> {
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        y: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
    ) -> Result<()> {
        let layer = self.kind == NormKind::Layer;
        norm::forward_into(
            self.kind,
            &norm::Fwd {
                x,
                residual: None,
                weight: Some(self.w),
                bias: self.b,
            },
            &norm::FwdOut {
                y,
                h: None,
                mean: layer.then_some(mean),
                rstd: Some(rstd),
            },
            &NormOptions {
                eps: EPS,
                ..Default::default()
            },
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dx: &Tensor,
        dw: &Tensor,
        db: Option<&Tensor>,
    ) -> Result<()> {
        let layer = self.kind == NormKind::Layer;
        norm::backward_into(
            self.kind,
            &norm::Bwd {
                dy,
                x,
                weight: Some(self.w),
                mean: layer.then_some(mean),
                rstd,
            },
            &norm::BwdOut {
                dx,
                dweight: Some(dw),
                dbias: db,
            },
            &NormOptions {
                eps: EPS,
                ..Default::default()
            },
        )
    }
}

impl Model {
    pub(crate) fn norm<'a>(&self, w: &'a Tensor, b: Option<&'a Tensor>) -> Norm<'a> {
        let kind = match self.cfg.family {
            Family::Gpt2 => NormKind::Layer,
            Family::Llama => NormKind::Rms,
        };
        Norm { kind, w, b }
    }

    fn attention_options(&self) -> AttentionOptions {
        AttentionOptions {
            causal: true,
            deterministic: self.opts.deterministic,
            ..Default::default()
        }
    }

    /// Rotary embeddings on q and k of a `[N, qkv_width]` buffer (in place; `inverse` for the
    /// gradient).
    pub(crate) fn rope(&self, buf: &Tensor, seq: usize, pos0: usize, inverse: bool) -> Result<()> {
        let cfg = &self.cfg;
        glue::rope(
            buf,
            seq,
            pos0,
            cfg.heads + cfg.kv_heads,
            cfg.head_dim(),
            cfg.rope_theta as f32,
            inverse,
        )
    }

    /// Forward over the loaded tokens; with `dloss` the logits are overwritten by the loss's
    /// gradient scaled by dloss (training), else kept. The mean loss lands in `loss_tensor()`.
    pub fn forward(&self, dloss: Option<f32>) -> Result<()> {
        let a = self.acts()?;
        let cfg = &self.cfg;
        let llama = cfg.family == Family::Llama;
        let (b, t, h, d) = (a.batch, a.seq, cfg.heads, cfg.head_dim());
        let p = &self.params;
        glue::embed_forward(&a.inputs, &p.wte, p.wpe.as_ref(), &a.res[0], t, cfg.vocab)?;
        self.mark("embed")?;
        let lin = LinearOptions::default();
        let gelu = LinearOptions {
            activation: Activation::GeluTanh,
            ..Default::default()
        };
        let aopts = self.attention_options();
        for (l, (w, s)) in p.blocks.iter().zip(&a.blocks).enumerate() {
            let x = &a.res[l];
            self.norm(&w.ln1_w, w.ln1_b.as_ref())
                .forward(x, &s.ln1, &s.ln1_mean, &s.ln1_rstd)?;
            self.mark("norm")?;
            linear_fwd(&s.ln1, &w.qkv_w, w.qkv_b.as_ref(), None, &s.qkv, None, &lin)?;
            self.mark("qkv")?;
            if llama {
                self.rope(&s.qkv, t, 0, false)?;
                self.mark("rope")?;
            }
            let base = s.qkv.layout().offset();
            let [q, k, v] = qkv_views(cfg, b, t, |o, sh, st| s.qkv.as_strided(sh, st, base + o))?;
            let o = s.att.reshape(&[b, t, h, d])?;
            attention::attention_forward_into(&q, &k, &v, &o, &s.lse, None, &aopts)?;
            self.mark("attention")?;
            linear_fwd(
                &s.att,
                &w.proj_w,
                w.proj_b.as_ref(),
                Some(x),
                &s.mid,
                None,
                &lin,
            )?;
            self.mark("proj (+ residual)")?;
            self.norm(&w.ln2_w, w.ln2_b.as_ref()).forward(
                &s.mid,
                &s.ln2,
                &s.ln2_mean,
                &s.ln2_rstd,
            )?;
            self.mark("norm")?;
            if llama {
                linear_fwd(&s.ln2, &w.fc_w, None, None, &s.fch_pre, None, &lin)?;
                self.mark("gate+up")?;
                activation::glu_into(&s.fch_pre, &s.fch, &swiglu())?;
                self.mark("swiglu")?;
            } else {
                linear_fwd(
                    &s.ln2,
                    &w.fc_w,
                    w.fc_b.as_ref(),
                    None,
                    &s.fch,
                    Some(&s.fch_pre),
                    &gelu,
                )?;
                self.mark("fc (+ bias, GELU)")?;
            }
            linear_fwd(
                &s.fch,
                &w.fcproj_w,
                w.fcproj_b.as_ref(),
                Some(&s.mid),
                &a.res[l + 1],
                None,
                &lin,
            )?;
            self.mark("down (+ residual)")?;
        }
        self.norm(&p.lnf_w, p.lnf_b.as_ref()).forward(
            &a.res[cfg.layers],
            &a.lnf,
            &a.lnf_mean,
            &a.lnf_rstd,
        )?;
        self.mark("norm")?;
        linear_fwd(&a.lnf, p.classifier(), None, None, &a.logits, None, &lin)?;
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

    /// The first tensor holding a NaN or infinity, in the order the step computes them: the
    /// parameters, then the forward's activations layer by layer, then the gradients. For the
    /// error a non-finite loss raises (reads every buffer back: slow, and only then).
    pub fn first_nonfinite(&self) -> Result<Option<String>> {
        let bad =
            |t: &Tensor| -> Result<bool> { Ok(t.to_f32_vec()?.iter().any(|x| !x.is_finite())) };
        let flat = |buf: &Tensor| -> Result<Option<String>> {
            let v = buf.to_f32_vec()?;
            Ok(self
                .layout
                .layout
                .slots
                .iter()
                .find(|(_, off, shape)| {
                    v[*off..off + shape.iter().product::<usize>()]
                        .iter()
                        .any(|x| !x.is_finite())
                })
                .map(|(name, _, _)| name.clone()))
        };
        if let Some(n) = flat(self.param_buffer())? {
            return Ok(Some(format!("parameter {n}")));
        }
        let a = self.acts()?;
        if bad(&a.res[0])? {
            return Ok(Some("activation embed (token + position)".into()));
        }
        for (l, s) in a.blocks.iter().enumerate() {
            let named = [
                ("norm1", &s.ln1),
                ("qkv", &s.qkv),
                ("attention", &s.att),
                ("attention + residual", &s.mid),
                ("norm2", &s.ln2),
                ("mlp up", &s.fch_pre),
                ("mlp hidden", &s.fch),
                ("block output", &a.res[l + 1]),
            ];
            for (name, t) in named {
                if bad(t)? {
                    return Ok(Some(format!("activation h{l}.{name}")));
                }
            }
        }
        if bad(&a.lnf)? {
            return Ok(Some("activation final norm".into()));
        }
        if bad(&a.logits.narrow(1, 0, self.cfg.vocab)?)? {
            return Ok(Some("logits (or their gradient)".into()));
        }
        Ok(flat(self.grad_buffer())?.map(|n| format!("gradient {n}")))
    }

    /// Refills block `l`'s norm outputs and MLP hidden activation (shared buffers under
    /// `recompute`) from what the forward kept: the residual stream, the norms' statistics and
    /// the MLP's pre-activation. GPT-2's GELU is recomputed from the bf16 pre-activation (the
    /// forward's epilogue took it from the fp32 accumulator): the same function, rounded once more.
    fn recompute_block(&self, l: usize) -> Result<()> {
        let a = self.acts()?;
        let (w, s) = (&self.params.blocks[l], &a.blocks[l]);
        self.norm(&w.ln1_w, w.ln1_b.as_ref()).forward(
            &a.res[l],
            &s.ln1,
            &s.ln1_mean,
            &s.ln1_rstd,
        )?;
        self.norm(&w.ln2_w, w.ln2_b.as_ref())
            .forward(&s.mid, &s.ln2, &s.ln2_mean, &s.ln2_rstd)?;
        match self.cfg.family {
            Family::Llama => activation::glu_into(&s.fch_pre, &s.fch, &swiglu())?,
            Family::Gpt2 => activation::bias_act_dropout_into(
                &s.fch_pre,
                None,
                &s.fch,
                &activation::ActOptions {
                    act: activation::Activation::GeluTanh,
                    ..Default::default()
                },
            )?,
        }
        self.mark("recompute")
    }

    /// A block norm's backward from `a.dln`, its input gradient added to the residual stream's
    /// (`dres += norm'(dln)`). `w`: (gain, bias); `stats`: (mean, rstd); `dw`: their gradients.
    fn norm_bwd_into_residual(
        &self,
        a: &Acts,
        w: (&Tensor, Option<&Tensor>),
        x: &Tensor,
        stats: (&Tensor, &Tensor),
        dw: (&Tensor, Option<&Tensor>),
    ) -> Result<()> {
        self.norm(w.0, w.1)
            .backward(&a.dln, x, stats.0, stats.1, &a.dtmp, dw.0, dw.1)?;
        self.mark("norm.bwd")?;
        glue::add_inplace(&a.dres, &a.dtmp)?;
        self.mark("residual add")
    }

    /// Backward after a training forward: every gradient written (overwritten) in `grads`.
    pub fn backward(&self) -> Result<()> {
        let a = self.acts()?;
        let cfg = &self.cfg;
        let llama = cfg.family == Family::Llama;
        let (b, t, h, d) = (a.batch, a.seq, cfg.heads, cfg.head_dim());
        let (p, g) = (&self.params, &self.grads);
        let lin = LinearOptions::default();
        let aopts = self.attention_options();
        // classifier: dlnf = dlogits·W, dW = dlogitsᵀ·lnf (GPT-2: W is wte, overwritten here
        // before the embedding backward adds to it)
        let dhead = g.head.as_ref().unwrap_or(&g.wte);
        linear_bwd(
            &a.logits,
            &a.lnf,
            p.classifier(),
            Some(&a.dln),
            Some(dhead),
            None,
            None,
            &lin,
        )?;
        self.mark("classifier.bwd")?;
        self.norm(&p.lnf_w, p.lnf_b.as_ref()).backward(
            &a.dln,
            &a.res[cfg.layers],
            &a.lnf_mean,
            &a.lnf_rstd,
            &a.dres,
            &g.lnf_w,
            g.lnf_b.as_ref(),
        )?;
        self.mark("norm.bwd")?;
        for l in (0..cfg.layers).rev() {
            let (w, gw, s) = (&p.blocks[l], &g.blocks[l], &a.blocks[l]);
            if self.opts.recompute {
                self.recompute_block(l)?;
            }
            if llama {
                linear_bwd(
                    &a.dres,
                    &s.fch,
                    &w.fcproj_w,
                    Some(&a.dfch),
                    Some(&gw.fcproj_w),
                    None,
                    None,
                    &lin,
                )?;
                self.mark("down.bwd")?;
                let dpre = a.dpre.as_ref().expect("Llama activations hold d[gate, up]");
                activation::glu_backward_into(&a.dfch, &s.fch_pre, dpre, &swiglu())?;
                self.mark("swiglu.bwd")?;
                linear_bwd(
                    dpre,
                    &s.ln2,
                    &w.fc_w,
                    Some(&a.dln),
                    Some(&gw.fc_w),
                    None,
                    None,
                    &lin,
                )?;
                self.mark("gate+up.bwd")?;
            } else {
                // fc2's dX GEMM applies GELU' and sums fc1's bias gradient (chain form)
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
                        db: gw.fcproj_b.as_ref(),
                        db_pre: gw.fc_b.as_ref(),
                    },
                    &lin,
                )?;
                self.mark("down.bwd (GELU' + fc bias in the epilogue)")?;
                linear_bwd(
                    &a.dfch,
                    &s.ln2,
                    &w.fc_w,
                    Some(&a.dln),
                    Some(&gw.fc_w),
                    None,
                    None,
                    &lin,
                )?;
                self.mark("fc.bwd")?;
            }
            self.norm_bwd_into_residual(
                a,
                (&w.ln2_w, w.ln2_b.as_ref()),
                &s.mid,
                (&s.ln2_mean, &s.ln2_rstd),
                (&gw.ln2_w, gw.ln2_b.as_ref()),
            )?;
            linear_bwd(
                &a.dres,
                &s.att,
                &w.proj_w,
                Some(&a.datt),
                Some(&gw.proj_w),
                gw.proj_b.as_ref(),
                None,
                &lin,
            )?;
            self.mark("proj.bwd")?;
            let base = s.qkv.layout().offset();
            let [q, k, v] = qkv_views(cfg, b, t, |o, sh, st| s.qkv.as_strided(sh, st, base + o))?;
            attention::attention_backward_into(
                &a.datt.reshape(&[b, t, h, d])?,
                &q,
                &k,
                &v,
                &s.att.reshape(&[b, t, h, d])?,
                &s.lse,
                &a.dq,
                &a.dk,
                &a.dv,
                None,
                &aopts,
            )?;
            self.mark("attention.bwd")?;
            if llama {
                self.rope(&a.dqkv, t, 0, true)?;
                self.mark("rope.bwd")?;
            }
            linear_bwd(
                &a.dqkv,
                &s.ln1,
                &w.qkv_w,
                Some(&a.dln),
                Some(&gw.qkv_w),
                gw.qkv_b.as_ref(),
                None,
                &lin,
            )?;
            self.mark("qkv.bwd")?;
            self.layer_grads_ready(l)?;
            self.norm_bwd_into_residual(
                a,
                (&w.ln1_w, w.ln1_b.as_ref()),
                &a.res[l],
                (&s.ln1_mean, &s.ln1_rstd),
                (&gw.ln1_w, gw.ln1_b.as_ref()),
            )?;
        }
        if llama {
            // the untied embedding's gradient comes from the scatter alone
            glue::zero(&g.wte)?;
        }
        glue::embed_backward(
            &a.inputs,
            &a.dres,
            &g.wte,
            g.wpe.as_ref(),
            t,
            cfg.vocab,
            Some(&a.keys),
        )?;
        self.mark("embed.bwd")?;
        self.all_grads_ready()
    }
}

pub(crate) fn swiglu() -> GluOptions {
    GluOptions {
        act: activation::Activation::Silu,
        ..Default::default()
    }
}

pub(crate) fn linear_fwd(
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
            z: None,
            x_pre: None,
        },
        &linear::BwdOut { dx, dw, db, db_pre },
        o,
    )
}
