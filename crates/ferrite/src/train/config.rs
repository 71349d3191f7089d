//! Model and run configuration: presets, parsing, and the checks that a configuration fits.

use crate::core::error::{Error, Result};

const OP: &str = "train";

/// The two decoder families the trainer builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Family {
    /// GPT-2: LayerNorm, learned positions, GELU (tanh) MLP, tied embeddings, biases everywhere.
    Gpt2,
    /// Llama: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, untied classifier,
    /// no biases.
    Llama,
}

/// A decoder-only transformer's shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    /// The preset's name (or a caller's label), shown in logs and checkpoints.
    pub name: String,
    /// GPT-2 or Llama.
    pub family: Family,
    /// Token ids are below this.
    pub vocab: usize,
    /// The longest sequence the model takes (GPT-2: rows of the position table).
    pub max_seq: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (= heads for GPT-2; a divisor of heads for Llama's grouped-query attention).
    pub kv_heads: usize,
    /// The residual stream's width (heads · head_dim).
    pub dim: usize,
    /// The MLP's hidden width (GPT-2: 4·dim; Llama: SwiGLU's, e.g. 5632 at dim 2048).
    pub ffn: usize,
    /// Rotary base θ (Llama).
    pub rope_theta: usize,
}

impl ModelConfig {
    /// A GPT-2 of the given shape (kv_heads = heads, ffn = 4·dim).
    pub fn gpt2(
        name: &str,
        vocab: usize,
        max_seq: usize,
        layers: usize,
        heads: usize,
        dim: usize,
    ) -> ModelConfig {
        ModelConfig {
            name: name.into(),
            family: Family::Gpt2,
            vocab,
            max_seq,
            layers,
            heads,
            kv_heads: heads,
            dim,
            ffn: 4 * dim,
            rope_theta: 10000,
        }
    }

    /// A Llama of the given shape.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        name: &str,
        vocab: usize,
        max_seq: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        dim: usize,
        ffn: usize,
    ) -> ModelConfig {
        ModelConfig {
            name: name.into(),
            family: Family::Llama,
            vocab,
            max_seq,
            layers,
            heads,
            kv_heads,
            dim,
            ffn,
            rope_theta: 10000,
        }
    }

    /// Presets: `gpt2-124m`, `gpt2-350m`, `gpt2-774m` (GPT-2's sizes, vocab 50257, 1024
    /// positions), `gpt2-tiny` (2 layers, dim 64: the CPU test model), `llama-1b` (16 layers, dim
    /// 2048, 32 query / 8 key-value heads, SwiGLU 5632, 2048 positions) and `llama-tiny`; the Llama
    /// presets take GPT-2's tokenizer (vocab 50257), as ferrite's shards are packed with it.
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let v = 50257;
        Ok(match name {
            "gpt2-124m" => Self::gpt2(name, v, 1024, 12, 12, 768),
            "gpt2-350m" => Self::gpt2(name, v, 1024, 24, 16, 1024),
            "gpt2-774m" => Self::gpt2(name, v, 1024, 36, 20, 1280),
            "gpt2-tiny" => Self::gpt2(name, v, 256, 2, 4, 64),
            "llama-1b" => Self::llama(name, v, 2048, 16, 32, 8, 2048, 5632),
            "llama-tiny" => Self::llama(name, v, 256, 2, 4, 2, 64, 176),
            _ => {
                return Err(Error::bad_arg(
                    OP,
                    "model",
                    "one of gpt2-124m, gpt2-350m, gpt2-774m, gpt2-tiny, llama-1b, llama-tiny",
                    name,
                ))
            }
        })
    }

    /// The vocabulary rounded up to a multiple of 128 (GPT-2: 50257 → 50304): the rows the
    /// embedding table and the classifier's GEMMs use, so their leading dimensions stay aligned
    /// for the tensor-core paths. Rows past `vocab` are zero and stay zero (no token selects
    /// them; their logits are 0 and cross-entropy sees only the first `vocab` columns).
    pub fn padded_vocab(&self) -> usize {
        self.vocab.div_ceil(128) * 128
    }

    /// dim / heads.
    pub fn head_dim(&self) -> usize {
        self.dim / self.heads.max(1)
    }

    /// Width of the fused QKV projection's output: (heads + 2·kv_heads)·head_dim.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    /// Width of the MLP's first GEMM output (GPT-2: ffn; Llama: gate and up, 2·ffn).
    pub fn up_width(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.ffn,
            Family::Llama => 2 * self.ffn,
        }
    }

    /// Checks the shape fits together (and, with `seq`, that a run's T fits the position table).
    pub fn validate(&self, seq: Option<usize>) -> Result<()> {
        let bad = |arg: &str, exp: String, got: String| Err(Error::bad_arg(OP, arg, exp, got));
        if self.layers == 0
            || self.heads == 0
            || self.dim == 0
            || self.vocab == 0
            || self.max_seq == 0
        {
            return bad(
                "model",
                "layers, heads, dim, vocab and max_seq all ≥ 1".into(),
                format!("{self:?}"),
            );
        }
        if !self.dim.is_multiple_of(self.heads) {
            return bad(
                "heads",
                format!("a divisor of dim {}", self.dim),
                self.heads.to_string(),
            );
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(
                "kv_heads",
                format!("a divisor of heads {}", self.heads),
                self.kv_heads.to_string(),
            );
        }
        if self.ffn == 0 {
            return bad("ffn", "≥ 1".into(), "0".into());
        }
        match self.family {
            Family::Gpt2 if self.kv_heads != self.heads => {
                return bad(
                    "kv_heads",
                    format!("= heads ({}) for GPT-2", self.heads),
                    self.kv_heads.to_string(),
                )
            }
            Family::Llama if !self.head_dim().is_multiple_of(2) || self.rope_theta < 2 => {
                return bad(
                    "head_dim/rope_theta",
                    "an even head dim and θ ≥ 2 (rotary embeddings)".into(),
                    format!("{}/{}", self.head_dim(), self.rope_theta),
                )
            }
            _ => {}
        }
        if self.vocab > i32::MAX as usize {
            return bad("vocab", "< 2³¹".into(), self.vocab.to_string());
        }
        if let Some(t) = seq {
            if t == 0 || t > self.max_seq {
                return bad(
                    "seq",
                    format!("1..={} (the model's position table)", self.max_seq),
                    t.to_string(),
                );
            }
        }
        Ok(())
    }

    /// Parameters, counted as the model holds them (GPT-2's tied embedding counted once; the
    /// vocabulary's padding rows not counted).
    pub fn num_params(&self) -> usize {
        let (c, l, f) = (self.dim, self.layers, self.ffn);
        let attn = c * self.qkv_width() + c * c;
        match self.family {
            Family::Gpt2 => {
                let per_layer = attn + self.qkv_width() + c + 2 * c * f + f + c + 4 * c;
                self.vocab * c + self.max_seq * c + l * per_layer + 2 * c
            }
            Family::Llama => {
                let per_layer = attn + 3 * c * f + 2 * c;
                2 * self.vocab * c + l * per_layer + c
            }
        }
    }

    /// Training FLOPs per token at sequence length `seq` (forward + backward = 3 × forward):
    /// 6 per weight of every matmul (the classifier included, embeddings excluded) and the
    /// attention scores and values (causal: half of 4·T·heads·head_dim per layer forward).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (c, l) = (self.dim as f64, self.layers as f64);
        let per_layer = c * self.qkv_width() as f64 + c * c + 3.0 * c * self.ffn as f64
            - if self.family == Family::Gpt2 {
                c * self.ffn as f64
            } else {
                0.0
            };
        let matmul_weights = l * per_layer + self.vocab as f64 * c;
        let attn_fwd = l * 2.0 * seq as f64 * c; // causal: half of 4·T·C
        6.0 * matmul_weights + 3.0 * attn_fwd
    }
}

/// The learning-rate schedule after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Schedule {
    /// Cosine from lr to lr·min_lr_frac over the steps after warm-up.
    Cosine,
    /// Warm-up, stable at lr, then a linear decay to lr·min_lr_frac over the last `decay_frac`
    /// of the steps (WSD).
    Wsd {
        /// The share of the steps spent decaying, in (0, 1].
        decay_frac: f64,
    },
    /// lr after warm-up, to the end.
    Constant,
}

impl Schedule {
    /// `cosine`, `wsd` (decaying over the last 20 %) or `constant`.
    pub fn parse(s: &str) -> Result<Schedule> {
        match s {
            "cosine" => Ok(Schedule::Cosine),
            "constant" => Ok(Schedule::Constant),
            "wsd" => Ok(Schedule::Wsd { decay_frac: 0.2 }),
            _ => Err(Error::bad_arg(OP, "schedule", "cosine, wsd or constant", s)),
        }
    }
}

/// One training run's settings.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// B: sequences per micro-batch.
    pub batch: usize,
    /// T: tokens per sequence.
    pub seq: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub grad_accum: usize,
    /// Optimizer steps of the run.
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// The schedule's floor as a fraction of `lr`.
    pub min_lr_frac: f64,
    /// Steps of linear warm-up from 0 to `lr`.
    pub warmup: usize,
    /// The shape of the learning rate after warm-up.
    pub schedule: Schedule,
    /// AdamW's decoupled weight decay (on matrices and embeddings, not on norms and biases).
    pub weight_decay: f64,
    /// AdamW's β1.
    pub beta1: f64,
    /// AdamW's β2.
    pub beta2: f64,
    /// AdamW's eps.
    pub eps: f64,
    /// Global gradient-norm clip (0: off).
    pub clip: f64,
    /// Seed of the initial weights and of the data order.
    pub seed: u64,
    /// Validation every this many steps (0: never), over `val_batches` batches.
    pub val_every: usize,
    /// Batches per validation.
    pub val_batches: usize,
    /// Skip the update of a step whose loss or gradient is not finite (else stop with an error).
    pub skip_nonfinite: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch: 4,
            seq: 64,
            grad_accum: 1,
            steps: 50,
            lr: 6e-4,
            min_lr_frac: 0.1,
            warmup: 10,
            schedule: Schedule::Cosine,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            clip: 1.0,
            seed: 1337,
            val_every: 0,
            val_batches: 4,
            skip_nonfinite: false,
        }
    }
}

impl TrainConfig {
    /// Checks the settings (sizes ≥ 1, rates and coefficients in range): an error names the
    /// field.
    pub fn validate(&self) -> Result<()> {
        let bad = |arg: &str, exp: &str, got: String| Err(Error::bad_arg(OP, arg, exp, got));
        if self.batch == 0 || self.seq == 0 || self.grad_accum == 0 {
            return bad(
                "batch/seq/grad_accum",
                "all ≥ 1",
                format!("{}/{}/{}", self.batch, self.seq, self.grad_accum),
            );
        }
        if (self.batch * self.seq) > i32::MAX as usize {
            return bad(
                "batch·seq",
                "< 2³¹ tokens per micro-batch",
                (self.batch * self.seq).to_string(),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "a finite number > 0", self.lr.to_string());
        }
        if !(0.0..=1.0).contains(&self.min_lr_frac) {
            return bad("min_lr_frac", "in [0, 1]", self.min_lr_frac.to_string());
        }
        if !(self.clip.is_finite() && self.clip >= 0.0) {
            return bad(
                "clip",
                "a finite number ≥ 0 (0: off)",
                self.clip.to_string(),
            );
        }
        if let Schedule::Wsd { decay_frac } = self.schedule {
            if !(0.0..=1.0).contains(&decay_frac) {
                return bad("decay_frac", "in [0, 1]", decay_frac.to_string());
            }
        }
        Ok(())
    }

    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: usize) -> f64 {
        let min = self.lr * self.min_lr_frac;
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let after = (step - self.warmup) as f64;
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Cosine => {
                let r = (after / span).min(1.0);
                min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * r).cos())
            }
            Schedule::Wsd { decay_frac } => {
                let decay_steps = (self.steps as f64 * decay_frac).max(1.0);
                let start = self.steps as f64 - decay_steps;
                if (step as f64) < start {
                    self.lr
                } else {
                    let r = ((step as f64 - start) / decay_steps).min(1.0);
                    self.lr + (min - self.lr) * r
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_param_counts() {
        // GPT-2 small: 124,439,808 parameters with the tied 50257-row embedding.
        let c = ModelConfig::preset("gpt2-124m").unwrap();
        assert_eq!(c.num_params(), 124_439_808);
        assert!(ModelConfig::preset("gpt9")
            .unwrap_err()
            .to_string()
            .contains("gpt2-124m"));
        let mut bad = c.clone();
        bad.heads = 7;
        assert!(bad
            .validate(None)
            .unwrap_err()
            .to_string()
            .contains("divisor of dim 768"));
        assert!(c
            .validate(Some(2048))
            .unwrap_err()
            .to_string()
            .contains("1..=1024"));
    }

    #[test]
    fn schedules() {
        let t = TrainConfig {
            steps: 100,
            warmup: 10,
            lr: 1.0,
            min_lr_frac: 0.1,
            ..Default::default()
        };
        assert!((t.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((t.lr_at(9) - 1.0).abs() < 1e-12);
        assert!((t.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((t.lr_at(100) - 0.1).abs() < 1e-9);
        assert!(t.lr_at(55) < 0.6 && t.lr_at(55) > 0.5);
        let w = TrainConfig {
            schedule: Schedule::Wsd { decay_frac: 0.2 },
            ..t
        };
        assert_eq!(w.lr_at(79), 1.0);
        assert!((w.lr_at(90) - 0.55).abs() < 1e-9);
    }
}
