//! Model and run configuration: presets, parsing, and the checks that a configuration fits.

use crate::core::error::{Error, Result};

const OP: &str = "train";

/// A GPT-2 style decoder: LayerNorm, learned positions, GELU (tanh) MLP of 4·dim, tied
/// embeddings, biases everywhere.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub name: String,
    pub vocab: usize,
    /// Rows of the position table: the longest sequence the model takes.
    pub max_seq: usize,
    pub layers: usize,
    pub heads: usize,
    pub dim: usize,
}

impl ModelConfig {
    /// Presets: `gpt2-124m`, `gpt2-350m`, `gpt2-774m` (GPT-2's sizes, vocab 50257, 1024
    /// positions) and `gpt2-tiny` (2 layers, dim 64: the CPU test model).
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let (layers, heads, dim, max_seq) = match name {
            "gpt2-124m" => (12, 12, 768, 1024),
            "gpt2-350m" => (24, 16, 1024, 1024),
            "gpt2-774m" => (36, 20, 1280, 1024),
            "gpt2-tiny" => (2, 4, 64, 256),
            _ => {
                return Err(Error::bad_arg(
                    OP,
                    "model",
                    "one of gpt2-124m, gpt2-350m, gpt2-774m, gpt2-tiny",
                    name,
                ))
            }
        };
        Ok(ModelConfig {
            name: name.into(),
            vocab: 50257,
            max_seq,
            layers,
            heads,
            dim,
        })
    }

    /// The vocabulary rounded up to a multiple of 128 (GPT-2: 50257 → 50304): the rows the
    /// embedding table and the classifier's GEMMs use, so their leading dimensions stay aligned
    /// for the tensor-core paths. Rows past `vocab` are zero and stay zero (no token selects
    /// them; their logits are 0 and cross-entropy sees only the first `vocab` columns).
    pub fn padded_vocab(&self) -> usize {
        self.vocab.div_ceil(128) * 128
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.heads.max(1)
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

    /// Parameters, counted as the model holds them (embeddings tied: counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.dim, self.layers);
        let per_layer = 12 * c * c + 13 * c;
        self.vocab * c + self.max_seq * c + l * per_layer + 2 * c
    }

    /// Training FLOPs per token at sequence length `seq` (forward + backward = 3 × forward):
    /// 6 per weight of every matmul (the tied classifier included, position table excluded)
    /// and the attention scores and values (causal: half of 4·T·dim per layer forward).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (c, l) = (self.dim as f64, self.layers as f64);
        let matmul_weights = l * 12.0 * c * c + self.vocab as f64 * c;
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
        decay_frac: f64,
    },
    Constant,
}

impl Schedule {
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
    pub steps: usize,
    pub lr: f64,
    pub min_lr_frac: f64,
    pub warmup: usize,
    pub schedule: Schedule,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip (0: off).
    pub clip: f64,
    pub seed: u64,
    /// Validation every this many steps (0: never), over `val_batches` batches.
    pub val_every: usize,
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
