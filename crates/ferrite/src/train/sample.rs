//! Text generation from a trained model with a paged KV cache: each new token runs one decode
//! step — its q, k, v from the block's QKV GEMM (M = 1), k and v written into the layer's cache
//! pages by `decode::append_kv`, attention over the cached keys by `decode::decode_into` (the
//! serving path's paged-attention kernels) — so a token costs one pass over the weights and the
//! cache, not a forward over the whole prefix. Sampling (temperature, top-k, top-p) on the host
//! from a seeded generator.

use super::config::Family;
use super::glue;
use super::model::Model;
use super::passes::{linear_fwd, swiglu};
use crate::core::act::Activation;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::ops::activation;
use crate::ops::decode::{self, AppendOptions, DecodeOptions, PagedKv};
use crate::ops::linear::LinearOptions;

/// Tokens per cache page (vLLM's default page size).
pub const PAGE: usize = 16;

/// How the next token is drawn from the logits.
#[derive(Clone, Copy, Debug)]
pub struct SampleOptions {
    /// 0: greedy (the most likely token).
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Seed of the draws: the same seed and prompt give the same text.
    pub seed: u64,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.95,
            seed: 0,
        }
    }
}

/// A decoding session over one sequence: the cache pages of every layer and the buffers of one
/// token's pass.
pub struct Sampler<'m> {
    m: &'m Model,
    len: usize,
    kcache: Vec<Tensor>,
    vcache: Vec<Tensor>,
    block_table: Tensor,
    seq_lens: Tensor,
    slot: Tensor,
    token: Tensor,
    x: Tensor,
    h: Tensor,
    qkv: Tensor,
    att: Tensor,
    mid: Tensor,
    pre: Tensor,
    hid: Tensor,
    mean: Tensor,
    rstd: Tensor,
    logits: Tensor,
}

impl<'m> Sampler<'m> {
    /// An empty sequence on `m`'s device, room for `m.cfg.max_seq` tokens.
    pub fn new(m: &'m Model) -> Result<Sampler<'m>> {
        let cfg = &m.cfg;
        let (dev, dt) = (m.device, m.dtype);
        let pages = cfg.max_seq.div_ceil(PAGE);
        let e = |shape: &[usize]| Tensor::empty(shape, dt, dev);
        let cache = || e(&[pages, PAGE, cfg.kv_heads, cfg.head_dim()]);
        let table: Vec<i32> = (0..pages as i32).collect();
        let i32s = |v: Vec<i32>, shape: &[usize]| Tensor::from_vec(v, shape)?.to_device(dev);
        Ok(Sampler {
            m,
            len: 0,
            kcache: (0..cfg.layers).map(|_| cache()).collect::<Result<_>>()?,
            vcache: (0..cfg.layers).map(|_| cache()).collect::<Result<_>>()?,
            block_table: i32s(table, &[1, pages])?,
            seq_lens: i32s(vec![0], &[1])?,
            slot: i32s(vec![0], &[1])?,
            token: i32s(vec![0], &[1])?,
            x: e(&[1, cfg.dim])?,
            h: e(&[1, cfg.dim])?,
            qkv: e(&[1, cfg.qkv_width()])?,
            att: e(&[1, cfg.heads * cfg.head_dim()])?,
            mid: e(&[1, cfg.dim])?,
            pre: e(&[1, cfg.up_width()])?,
            hid: e(&[1, cfg.ffn])?,
            mean: Tensor::empty(&[1], DType::F32, dev)?,
            rstd: Tensor::empty(&[1], DType::F32, dev)?,
            logits: e(&[1, cfg.padded_vocab()])?,
        })
    }

    /// Tokens in the sequence so far.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no token was given or generated yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn set(t: &Tensor, v: i32) -> Result<()> {
        glue::upload_bytes(t, &v.to_le_bytes())
    }

    /// Appends `token` and returns the logits `[vocab]` for the next position.
    pub fn push(&mut self, token: u32) -> Result<Vec<f32>> {
        let m = self.m;
        let cfg = &m.cfg;
        if self.len >= cfg.max_seq {
            return Err(Error::bad_arg(
                "train::sample",
                "length",
                format!("at most {} tokens (the model's max_seq)", cfg.max_seq),
                self.len + 1,
            ));
        }
        if token as usize >= cfg.vocab {
            return Err(Error::bad_arg(
                "train::sample",
                "token",
                format!("an id below the vocabulary's {}", cfg.vocab),
                token,
            ));
        }
        let pos = self.len;
        let p = &m.params;
        let (d, hq, hk) = (cfg.head_dim(), cfg.heads, cfg.kv_heads);
        Self::set(&self.token, token as i32)?;
        Self::set(&self.slot, pos as i32)?;
        Self::set(&self.seq_lens, pos as i32 + 1)?;
        let wpe = p.wpe.as_ref().map(|w| w.narrow(0, pos, 1)).transpose()?;
        glue::embed_forward(&self.token, &p.wte, wpe.as_ref(), &self.x, 1, cfg.vocab)?;
        let lin = LinearOptions::default();
        let gelu = LinearOptions {
            activation: Activation::GeluTanh,
            ..Default::default()
        };
        let w_ = cfg.qkv_width();
        let view = |o: usize, heads: usize| self.qkv.as_strided(&[1, heads, d], &[w_, d, 1], o);
        for (l, w) in p.blocks.iter().enumerate() {
            m.norm(&w.ln1_w, w.ln1_b.as_ref())
                .forward(&self.x, &self.h, &self.mean, &self.rstd)?;
            linear_fwd(
                &self.h,
                &w.qkv_w,
                w.qkv_b.as_ref(),
                None,
                &self.qkv,
                None,
                &lin,
            )?;
            if cfg.family == Family::Llama {
                m.rope(&self.qkv, 1, pos, false)?;
            }
            let (q, k, v) = (view(0, hq)?, view(hq * d, hk)?, view((hq + hk) * d, hk)?);
            decode::append_kv(
                &k,
                &v,
                &self.kcache[l],
                &self.vcache[l],
                &self.slot,
                &AppendOptions::default(),
            )?;
            let kv = PagedKv {
                key_cache: &self.kcache[l],
                value_cache: &self.vcache[l],
                block_table: &self.block_table,
                seq_lens: &self.seq_lens,
            };
            decode::decode_into(
                &q,
                &kv,
                &self.att.reshape(&[1, hq, d])?,
                None,
                &DecodeOptions::default(),
            )?;
            linear_fwd(
                &self.att,
                &w.proj_w,
                w.proj_b.as_ref(),
                Some(&self.x),
                &self.mid,
                None,
                &lin,
            )?;
            m.norm(&w.ln2_w, w.ln2_b.as_ref())
                .forward(&self.mid, &self.h, &self.mean, &self.rstd)?;
            match cfg.family {
                Family::Llama => {
                    linear_fwd(&self.h, &w.fc_w, None, None, &self.pre, None, &lin)?;
                    activation::glu_into(&self.pre, &self.hid, &swiglu())?;
                }
                Family::Gpt2 => {
                    linear_fwd(
                        &self.h,
                        &w.fc_w,
                        w.fc_b.as_ref(),
                        None,
                        &self.hid,
                        Some(&self.pre),
                        &gelu,
                    )?;
                }
            }
            // the block's output becomes the next block's input (x)
            linear_fwd(
                &self.hid,
                &w.fcproj_w,
                w.fcproj_b.as_ref(),
                Some(&self.mid),
                &self.x,
                None,
                &lin,
            )?;
        }
        m.norm(&p.lnf_w, p.lnf_b.as_ref())
            .forward(&self.x, &self.h, &self.mean, &self.rstd)?;
        linear_fwd(
            &self.h,
            p.classifier(),
            None,
            None,
            &self.logits,
            None,
            &lin,
        )?;
        self.len += 1;
        self.logits.narrow(1, 0, cfg.vocab)?.to_f32_vec()
    }
}

/// The index drawn from `logits` under `o` (greedy when the temperature is 0).
pub fn pick(logits: &[f32], o: &SampleOptions, rng: &mut Rng) -> Result<u32> {
    if logits.iter().any(|x| x.is_nan()) {
        return Err(Error::Other("train::sample: the logits hold NaN".into()));
    }
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0)
    };
    if o.temperature <= 0.0 || o.top_k == 1 {
        return Ok(argmax());
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if o.top_k > 0 {
        idx.truncate(o.top_k);
    }
    let top = logits[idx[0]];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - top) / o.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if o.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|&p| {
                acc += p;
                acc >= o.top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        idx.truncate(keep);
        probs.truncate(keep);
        let t: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= t);
    }
    let mut u = rng.next_f64();
    for (i, p) in idx.iter().zip(&probs) {
        if u < *p {
            return Ok(*i as u32);
        }
        u -= p;
    }
    Ok(*idx.last().unwrap() as u32)
}

/// Continues `prompt` (token ids, at least one) by `new_tokens` tokens; returns the new ones.
pub fn generate(
    m: &Model,
    prompt: &[u32],
    new_tokens: usize,
    o: &SampleOptions,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(Error::bad_arg(
            "train::sample",
            "prompt",
            "at least one token",
            "none",
        ));
    }
    let mut s = Sampler::new(m)?;
    let mut rng = Rng::new(o.seed);
    let mut logits = Vec::new();
    for &t in prompt {
        logits = s.push(t)?;
    }
    let mut out = Vec::with_capacity(new_tokens);
    for i in 0..new_tokens {
        let t = pick(&logits, o, &mut rng)?;
        out.push(t);
        if i + 1 < new_tokens && s.len() < m.cfg.max_seq {
            logits = s.push(t)?;
        } else {
            break;
        }
    }
    Ok(out)
}

/// A model for inference from a checkpoint folder written by `ferrite train --save`, on `device`
/// in the checkpoint's dtype.
pub fn load(dir: &std::path::Path, device: Device) -> Result<Model> {
    let meta = super::checkpoint::read_meta(dir)?;
    let dtype = match meta.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => {
            return Err(Error::bad_arg(
                "train::sample",
                "checkpoint dtype",
                "f32 or bf16",
                other,
            ))
        }
    };
    let m = Model::new(
        &meta.model,
        dtype,
        device,
        0,
        super::model::ModelOptions::default(),
    )?;
    super::checkpoint::load_state(&m, dir)?;
    Ok(m)
}
