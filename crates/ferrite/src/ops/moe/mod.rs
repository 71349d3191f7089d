//! # moe — a mixture-of-experts layer: router, permutation, grouped expert GEMMs, combine, and
//! the backward of all of it
//!
//! **Layer** (`moe_forward`): for x `[T, H]`, router weight `[E, H]` (an `nn.Linear(H, E)`'s),
//! expert weights `w_up [E, H, 2I]` (gate = the first I columns, up = the last I: the GLU
//! convention of the activation family) and `w_down [E, I, H]`:
//! 1. logits = x·routerᵀ `[T, E]`; scores s = softmax(logits) or sigmoid(logits);
//! 2. with `groups > 1` and `topk_groups < groups`, only the experts of the `topk_groups` groups of
//!    largest group score (sum of its two best scores) are eligible (DeepSeek-V3); the `top_k`
//!    eligible experts of largest score are chosen, ties to the lower index; weights = their
//!    scores, renormalised to sum 1 when `renormalize`, times `routed_scale`;
//! 3. with a capacity factor, expert e keeps its first `capacity = ceil(T·k/E · factor)` pairs in
//!    token order and drops the rest (a dropped pair adds nothing to its token's output);
//! 4. `out[t] = Σ_j w[t,j] · (act(x[t]·W_up,gate) ⊙ x[t]·W_up,up)·W_down` for `e = idx[t,j]`.
//!
//! Losses (reported in `MoeMetrics`, and their gradients added by `moe_backward`): the Switch
//! auxiliary loss `aux_loss_coef·E·Σ_e f_e·P_e` (f_e = pairs routed to e / (T·k), P_e = mean
//! score of e) and the router z-loss `z_loss_coef·mean_t logsumexp(logits_t)²`.
//!
//! The routed tokens live in a padded expert-contiguous layout (kernels/moe.cu): expert e's rows
//! are `[ends[e-1], ends[e])`, its kept pairs in token order, then zero rows to a multiple of
//! `ALIGN` = 128; it has at most `T·k + E·127` rows, allocated once, filled on the device.
//!
//! **grouped_mm** (`torch._grouped_mm`'s semantics for 2-D A and 3-D B): `out[rows of g] =
//! a[rows of g]·b[g]` for cumulative row ends `offs` (int32 `[G]`, nondecreasing, the last = the
//! rows of a).
//!
//! Variants — CPU: `naive` (one thread, expert by expert), `parallel` (matmul's packed SIMD
//! GEMM per expert on every core). CUDA: `naive` (a loop over experts calling matmul with the host reading the counts:
//! what a PyTorch user writes), `grouped` (the device plans the layout, one grouped `mma.sync`
//! launch per GEMM, no host synchronisation: graph-capturable), `wgmma` (the same with Hopper's
//! persistent TMA + wgmma grouped kernels), `fused` (`wgmma` with the GLU computed in the up
//! projection's epilogue: no GLU pass). Routing, permutation and combine kernels are shared
//! by the CUDA variants (kernels/moe.cu).

// The rungs (CPU code, CUDA host code) and the family's check and bench: pub for the harness,
// the CLI and the families that reuse each other's rungs; the API is this module's items.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod cpu;
#[doc(hidden)]
pub mod cuda;
pub mod ep;
mod grouped;

pub use ep::{EpForward, ExpertParallel};
pub use grouped::{grouped_mm, grouped_mm_weight_grad};

pub use crate::core::act::Activation;
use crate::core::cuda::Stream;
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "moe";
/// Rows each expert's segment of the permuted layout is padded to.
pub const ALIGN: usize = 128;
/// Most experts a layer takes (the grouped kernels keep per-expert prefix sums in shared memory).
pub const MAX_EXPERTS: usize = 1024;
/// Most experts a token is routed to (one warp's lanes hold the choices).
pub const MAX_TOP_K: usize = 32;
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];
const HALFS: &[DType] = &[DType::F16, DType::BF16];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo { name: "naive", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "one thread: router, layout, then each expert's GEMMs in turn", rank: 1 },
        VariantInfo { name: "parallel", backend: Backend::Cpu, dtypes: FLOATS, min_arch: None, constraints: "any shape", summary: "the per-token loops across cores, each expert's GEMMs on matmul's packed SIMD kernel", rank: 2 },
        VariantInfo { name: "naive", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "a loop over experts calling matmul (cuBLAS-class per-expert GEMMs); the host waits for the routing to size each call", rank: 1 },
        VariantInfo { name: "grouped", backend: Backend::Cuda, dtypes: FLOATS, min_arch: Some(Arch::SM80), constraints: "any shape", summary: "layout planned on the device, one grouped mma.sync launch per GEMM over every expert; no host synchronisation (CUDA-graph safe)", rank: 2 },
        VariantInfo { name: "wgmma", backend: Backend::Cuda, dtypes: HALFS, min_arch: Some(Arch::SM90), constraints: "16-byte aligned rows (H, I multiples of 8)", summary: "the grouped launches on Hopper's persistent TMA + wgmma kernel (walks every expert's tiles)", rank: 3 },
        VariantInfo { name: "fused", backend: Backend::Cuda, dtypes: HALFS, min_arch: Some(Arch::SM90), constraints: "16-byte aligned rows (H, I multiples of 8)", summary: "wgmma with the GLU in the up projection's epilogue (act(gate) ⊙ up out of the accumulators: no GLU pass)", rank: 4 },
    ]
}

/// How the router scores experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Score {
    /// Softmax over the experts (Mixtral, Qwen3-MoE).
    #[default]
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

impl Score {
    /// The kernels' code (0 softmax, 1 sigmoid).
    pub fn code(self) -> i32 {
        match self {
            Score::Softmax => 0,
            Score::Sigmoid => 1,
        }
    }
    /// `softmax` or `sigmoid`.
    pub fn parse(s: &str) -> Result<Score> {
        match s {
            "softmax" => Ok(Score::Softmax),
            "sigmoid" => Ok(Score::Sigmoid),
            _ => Err(Error::bad_arg(OP, "score", "softmax or sigmoid", s)),
        }
    }
}

/// A layer's routing and expert configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// E: experts in the layer.
    pub experts: usize,
    /// k: experts each token is routed to.
    pub top_k: usize,
    /// How the router scores experts.
    pub score: Score,
    /// Scale the chosen experts' weights to sum to 1.
    pub renormalize: bool,
    /// Expert groups for group-limited routing (1: none).
    pub groups: usize,
    /// Groups a token may use (= groups: no limit).
    pub topk_groups: usize,
    /// Multiplies every routing weight (DeepSeek-V3's 2.5).
    pub routed_scale: f32,
    /// None: dropless; Some(f): each expert keeps at most ceil(T·k/E·f) pairs.
    pub capacity_factor: Option<f32>,
    /// Weight of the Switch auxiliary load-balancing loss (0: off).
    pub aux_loss_coef: f32,
    /// Weight of the router z-loss (0: off).
    pub z_loss_coef: f32,
    /// The experts' GLU activation: silu (SwiGLU) or gelu_tanh / gelu_erf (GEGLU).
    pub act: Activation,
}

impl MoeConfig {
    /// Softmax top-k, renormalised (Mixtral, Qwen3-MoE), dropless, SwiGLU, no losses.
    pub fn new(experts: usize, top_k: usize) -> MoeConfig {
        MoeConfig {
            experts,
            top_k,
            score: Score::Softmax,
            renormalize: true,
            groups: 1,
            topk_groups: 1,
            routed_scale: 1.0,
            capacity_factor: None,
            aux_loss_coef: 0.0,
            z_loss_coef: 0.0,
            act: Activation::Silu,
        }
    }

    /// Pairs each expert keeps (None: dropless).
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|f| {
            ((tokens as f64 * self.top_k as f64 / self.experts as f64) * f as f64).ceil() as usize
        })
    }

    /// Checks the configuration for `tokens` tokens.
    pub fn validate(&self, tokens: usize) -> Result<()> {
        let e = self.experts;
        if e == 0 || e > MAX_EXPERTS {
            return Err(Error::bad_arg(
                OP,
                "experts",
                format!("1..={MAX_EXPERTS}"),
                e,
            ));
        }
        if self.top_k == 0 || self.top_k > e || self.top_k > MAX_TOP_K {
            return Err(Error::bad_arg(
                OP,
                "top_k",
                format!("1..=min(experts = {e}, {MAX_TOP_K})"),
                self.top_k,
            ));
        }
        if self.groups == 0 || self.groups > 32 || !e.is_multiple_of(self.groups) {
            return Err(Error::bad_arg(
                OP,
                "groups",
                format!("1..=32 dividing experts = {e}"),
                self.groups,
            ));
        }
        if self.topk_groups == 0 || self.topk_groups > self.groups {
            return Err(Error::bad_arg(
                OP,
                "topk_groups",
                format!("1..=groups = {}", self.groups),
                self.topk_groups,
            ));
        }
        let eligible = self.topk_groups * (e / self.groups);
        if self.top_k > eligible {
            return Err(Error::bad_arg(
                OP,
                "top_k",
                format!("≤ the experts of topk_groups groups ({eligible})"),
                self.top_k,
            ));
        }
        if let Some(f) = self.capacity_factor {
            if !(f > 0.0 && f.is_finite()) {
                return Err(Error::bad_arg(
                    OP,
                    "capacity_factor",
                    "a finite value > 0",
                    f,
                ));
            }
        }
        for (name, v) in [
            ("routed_scale", self.routed_scale),
            ("aux_loss_coef", self.aux_loss_coef),
            ("z_loss_coef", self.z_loss_coef),
        ] {
            if !v.is_finite() {
                return Err(Error::bad_arg(OP, name, "a finite value", v));
            }
        }
        if !matches!(
            self.act,
            Activation::Silu | Activation::GeluTanh | Activation::GeluErf | Activation::Relu
        ) {
            return Err(Error::bad_arg(
                OP,
                "act",
                "silu, gelu_tanh, gelu_erf or relu (the GLU's gate activation)",
                self.act.name(),
            ));
        }
        let pairs = tokens.checked_mul(self.top_k);
        let rows = pairs.and_then(|p| p.checked_add(e * (ALIGN - 1)));
        if tokens == 0 || rows.is_none_or(|r| r > i32::MAX as usize) {
            return Err(Error::bad_arg(
                OP,
                "x",
                format!(
                    "1 ≤ tokens with T·k + E·{} < 2³¹ (int32 row indices)",
                    ALIGN - 1
                ),
                tokens,
            ));
        }
        Ok(())
    }
}

/// Options of one layer call. `Default`: best variant, the device's own stream, a forward
/// whose backward may follow.
#[derive(Clone, Debug, Default)]
pub struct MoeOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// A forward no backward will follow (inference): `fused` then stores only the GLU output,
    /// not the pre-activations `hpre` the backward reads (a third of its epilogue's stores), and
    /// `moe_backward` refuses the state.
    pub forward_only: bool,
}

/// The layer's weights.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    /// `[E, H]`.
    pub router: &'a Tensor,
    /// `[E, H, 2I]`: gate columns first.
    pub w_up: &'a Tensor,
    /// `[E, I, H]`.
    pub w_down: &'a Tensor,
}

/// A validated layer call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    /// T: tokens.
    pub tokens: usize,
    /// H: the model dim.
    pub hidden: usize,
    /// I: each expert's intermediate dim.
    pub inter: usize,
    /// E: experts.
    pub experts: usize,
    /// k: experts per token.
    pub top_k: usize,
    /// The shared dtype of x and the weights.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

impl Problem {
    /// Rows the permuted buffers are allocated with: every pair plus each expert's padding.
    pub fn rows_cap(&self) -> usize {
        self.tokens * self.top_k + self.experts * (ALIGN - 1)
    }
    /// FLOPs of the expert GEMMs for `rows` routed rows (forward): up 2·rows·H·2I, down
    /// 2·rows·I·H.
    pub fn expert_flops(&self, rows: usize) -> f64 {
        6.0 * rows as f64 * self.hidden as f64 * self.inter as f64
    }
    /// `T… H… I… E… k…`, as the tables show it.
    pub fn label(&self) -> String {
        format!(
            "T{} H{} I{} E{} k{}",
            self.tokens, self.hidden, self.inter, self.experts, self.top_k
        )
    }
}

fn expect(t: &Tensor, arg: &str, shape: &[usize], dtype: DType, device: Device) -> Result<()> {
    if t.shape() != shape || t.dtype() != dtype || t.device() != device || !t.is_contiguous() {
        return Err(Error::bad_arg(
            OP,
            arg,
            format!("a contiguous {dtype}{shape:?} on {device}"),
            describe(t),
        ));
    }
    Ok(())
}

/// Checks a layer call's inputs.
pub fn validate(x: &Tensor, w: &MoeWeights, cfg: &MoeConfig) -> Result<Problem> {
    if x.rank() != 2 || !x.is_contiguous() || !FLOATS.contains(&x.dtype()) {
        return Err(Error::bad_arg(
            OP,
            "x",
            "a contiguous f32/f16/bf16 [tokens, hidden]",
            describe(x),
        ));
    }
    let (t, h) = (x.shape()[0], x.shape()[1]);
    cfg.validate(t)?;
    let (dt, dev, e) = (x.dtype(), x.device(), cfg.experts);
    if h == 0 {
        return Err(Error::bad_arg(OP, "x", "hidden ≥ 1", describe(x)));
    }
    expect(w.router, "router", &[e, h], dt, dev)?;
    if w.w_up.rank() != 3 || !w.w_up.shape()[2].is_multiple_of(2) || w.w_up.shape()[2] == 0 {
        return Err(Error::bad_arg(
            OP,
            "w_up",
            format!("[experts = {e}, hidden = {h}, 2·inter] (gate | up)"),
            describe(w.w_up),
        ));
    }
    let i = w.w_up.shape()[2] / 2;
    expect(w.w_up, "w_up", &[e, h, 2 * i], dt, dev)?;
    expect(w.w_down, "w_down", &[e, i, h], dt, dev)?;
    Ok(Problem {
        tokens: t,
        hidden: h,
        inter: i,
        experts: e,
        top_k: cfg.top_k,
        dtype: dt,
        device: dev,
    })
}

/// How many buffers a forward's state has (`MoeForward::layout`).
pub const FORWARD_BUFFERS: usize = 14;

/// Everything a forward produced and its backward reads: the output, the routing, the layout and
/// the expert activations (all on the layer's device).
pub struct MoeForward {
    /// The validated call.
    pub problem: Problem,
    /// `[T, H]`.
    pub out: Tensor,
    /// `[T, E]` in the layer's dtype.
    pub logits: Tensor,
    /// `[T, E]` f32: the scores.
    pub probs: Tensor,
    /// `[T]` f32: logsumexp of each token's logits.
    pub lse: Tensor,
    /// `[T, k]` i32 / f32: chosen experts (best first) and their weights.
    pub idx: Tensor,
    /// `[T, k]` f32: the chosen experts' routing weights.
    pub weights: Tensor,
    /// `[T·k]` i32: each pair's row in the layout (-1: dropped).
    pub pos: Tensor,
    /// `[rows_cap]` i32: each row's pair (-1: padding or unused).
    pub src: Tensor,
    /// `[E]` i32: cumulative row ends of the experts' segments.
    pub ends: Tensor,
    /// `[E]` i32: pairs routed to each expert (before any drop).
    pub counts: Tensor,
    /// `[2]` i32: pairs dropped, rows used.
    pub stats: Tensor,
    /// `[2 + E]` f32: aux loss, z-loss, mean score per expert.
    pub losses: Tensor,
    /// Layout rows: x gathered `[rows_cap, H]`, up projection `[rows_cap, 2I]` (gate | up): what
    /// the backward needs. The GLU output and the down projection are workspaces of the forward
    /// (the backward recomputes the GLU from `hpre` and takes the gates' gradient from its own
    /// down-projection GEMM).
    pub xp: Tensor,
    /// The up projection's output `[rows_cap, 2I]` (gate | up), before the GLU; on CUDA the
    /// backward overwrites it with its gradient.
    pub hpre: Tensor,
    /// Whether the last forward into these buffers kept what the backward reads (not
    /// `forward_only`) and no backward has consumed it yet.
    backward_ready: std::sync::atomic::AtomicBool,
}

/// What a step's routing did (read back from the device on request).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeMetrics {
    /// Pairs routed to each expert (before any drop).
    pub tokens_per_expert: Vec<usize>,
    /// Pairs dropped by the capacity limit.
    pub dropped: usize,
    /// Rows of the layout in use (kept pairs plus padding).
    pub rows_used: usize,
    /// The auxiliary loss, times its coefficient.
    pub aux_loss: f32,
    /// The z-loss, times its coefficient.
    pub z_loss: f32,
    /// Fraction of experts that received at least one pair.
    pub experts_used: f64,
    /// The most pairs any expert received.
    pub max_load: usize,
    /// Pairs per expert on average.
    pub mean_load: f64,
    /// mean_load / max_load (1 = perfectly balanced).
    pub balance: f64,
}

/// A tensor of `shape`/`dtype` on `p`'s device (in stream order on `stream` when given).
fn alloc_like(
    p: &Problem,
    shape: &[usize],
    dtype: DType,
    stream: Option<&Stream>,
) -> Result<Tensor> {
    match (p.device, stream) {
        (Device::Cuda(i), Some(s)) => {
            Tensor::empty_on(shape, dtype, &crate::core::cuda::device(i)?, s)
        }
        _ => Tensor::empty(shape, dtype, p.device),
    }
}

impl MoeForward {
    /// The (name, shape, dtype) of every buffer of a forward of `p`, in field order.
    pub fn layout(p: &Problem) -> Vec<(&'static str, Vec<usize>, DType)> {
        let (t, h, i, e, k, dt) = (p.tokens, p.hidden, p.inter, p.experts, p.top_k, p.dtype);
        let r = p.rows_cap();
        vec![
            ("out", vec![t, h], dt),
            ("logits", vec![t, e], dt),
            ("probs", vec![t, e], DType::F32),
            ("lse", vec![t], DType::F32),
            ("idx", vec![t, k], DType::I32),
            ("weights", vec![t, k], DType::F32),
            ("pos", vec![t * k], DType::I32),
            ("src", vec![r], DType::I32),
            ("ends", vec![e], DType::I32),
            ("counts", vec![e], DType::I32),
            ("stats", vec![2], DType::I32),
            ("losses", vec![2 + e], DType::F32),
            ("xp", vec![r, h], dt),
            ("hpre", vec![r, 2 * i], dt),
        ]
    }

    fn fields(&self) -> [&Tensor; FORWARD_BUFFERS] {
        [
            &self.out,
            &self.logits,
            &self.probs,
            &self.lse,
            &self.idx,
            &self.weights,
            &self.pos,
            &self.src,
            &self.ends,
            &self.counts,
            &self.stats,
            &self.losses,
            &self.xp,
            &self.hpre,
        ]
    }

    /// Buffers for a forward of `p` (uninitialised on a GPU).
    pub fn alloc(p: &Problem, stream: Option<&Stream>) -> Result<MoeForward> {
        Self::alloc_with(p, stream, true)
    }

    /// As `alloc`, with `hpre` empty (`[0, 2I]`) unless `with_hpre`: the routing rank's state
    /// of an expert-parallel layer, whose experts' activations live on the ranks owning them.
    fn alloc_with(p: &Problem, stream: Option<&Stream>, with_hpre: bool) -> Result<MoeForward> {
        let mut ts = Self::layout(p)
            .into_iter()
            .map(|(name, mut shape, dt)| {
                if name == "hpre" && !with_hpre {
                    shape[0] = 0;
                }
                alloc_like(p, &shape, dt, stream)
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let mut next = || ts.next().unwrap();
        Ok(MoeForward {
            problem: *p,
            out: next(),
            logits: next(),
            probs: next(),
            lse: next(),
            idx: next(),
            weights: next(),
            pos: next(),
            src: next(),
            ends: next(),
            counts: next(),
            stats: next(),
            losses: next(),
            xp: next(),
            hpre: next(),
            backward_ready: false.into(),
        })
    }

    /// Caller-provided buffers (`MoeForward::layout`'s shapes and dtypes, contiguous, on `p`'s
    /// device, none sharing storage with another or with the layer's inputs).
    pub fn from_buffers(p: &Problem, ts: [Tensor; FORWARD_BUFFERS]) -> Result<MoeForward> {
        for ((name, shape, dt), t) in Self::layout(p).iter().zip(&ts) {
            expect(t, name, shape, *dt, p.device)?;
        }
        for a in 0..FORWARD_BUFFERS {
            for b in a + 1..FORWARD_BUFFERS {
                if ts[a].shares_storage(&ts[b]) {
                    return Err(Error::bad_arg(
                        OP,
                        Self::layout(p)[b].0,
                        "a buffer of its own",
                        format!("a view of `{}`", Self::layout(p)[a].0),
                    ));
                }
            }
        }
        let [out, logits, probs, lse, idx, weights, pos, src, ends, counts, stats, losses, xp, hpre] =
            ts;
        Ok(MoeForward {
            problem: *p,
            out,
            logits,
            probs,
            lse,
            idx,
            weights,
            pos,
            src,
            ends,
            counts,
            stats,
            losses,
            xp,
            hpre,
            // Caller-provided buffers carry a forward made elsewhere (the PyTorch op's saved
            // tensors): only forwards with a gradient to come are saved there.
            backward_ready: true.into(),
        })
    }

    /// The step's routing metrics (waits for the device).
    pub fn metrics(&self) -> Result<MoeMetrics> {
        let counts: Vec<usize> = self
            .counts
            .to_vec::<i32>()?
            .iter()
            .map(|&c| c as usize)
            .collect();
        let stats = self.stats.to_vec::<i32>()?;
        let losses = self.losses.to_vec::<f32>()?;
        let e = counts.len().max(1);
        let max_load = counts.iter().copied().max().unwrap_or(0);
        let mean_load = counts.iter().sum::<usize>() as f64 / e as f64;
        Ok(MoeMetrics {
            experts_used: counts.iter().filter(|&&c| c > 0).count() as f64 / e as f64,
            tokens_per_expert: counts,
            dropped: stats[0] as usize,
            rows_used: stats[1] as usize,
            aux_loss: losses[0],
            z_loss: losses[1],
            max_load,
            mean_load,
            balance: if max_load > 0 {
                mean_load / max_load as f64
            } else {
                0.0
            },
        })
    }
}

/// Gradients of a layer call.
pub struct MoeGrads {
    /// `[T, H]`.
    pub dx: Tensor,
    /// `[E, H]`.
    pub d_router: Tensor,
    /// `[E, H, 2I]`.
    pub dw_up: Tensor,
    /// `[E, I, H]`.
    pub dw_down: Tensor,
}

impl MoeGrads {
    /// Buffers for the gradients of `p` (uninitialised on a GPU).
    pub fn alloc(p: &Problem, stream: Option<&Stream>) -> Result<MoeGrads> {
        let (t, h, i, e, dt) = (p.tokens, p.hidden, p.inter, p.experts, p.dtype);
        Ok(MoeGrads {
            dx: alloc_like(p, &[t, h], dt, stream)?,
            d_router: alloc_like(p, &[e, h], dt, stream)?,
            dw_up: alloc_like(p, &[e, h, 2 * i], dt, stream)?,
            dw_down: alloc_like(p, &[e, i, h], dt, stream)?,
        })
    }

    fn check(&self, p: &Problem, ins: &[&Tensor]) -> Result<()> {
        let (t, h, i, e, dt) = (p.tokens, p.hidden, p.inter, p.experts, p.dtype);
        let outs = [
            ("dx", &self.dx, vec![t, h]),
            ("d_router", &self.d_router, vec![e, h]),
            ("dw_up", &self.dw_up, vec![e, h, 2 * i]),
            ("dw_down", &self.dw_down, vec![e, i, h]),
        ];
        for (n, (name, tt, shape)) in outs.iter().enumerate() {
            expect(tt, name, shape, dt, p.device)?;
            if ins
                .iter()
                .chain(outs[..n].iter().map(|o| &o.1))
                .any(|x| tt.shares_storage(x))
            {
                return Err(Error::bad_arg(
                    OP,
                    *name,
                    "a buffer of its own",
                    "a view of an input or another gradient",
                ));
            }
        }
        Ok(())
    }
}

fn select(p: &Problem, requested: Option<&str>) -> Result<&'static str> {
    let vs = variants();
    let arch = crate::core::cuda::arch_of(p.device)?;
    let v = variant::select(
        OP,
        &vs,
        requested,
        Backend::of(p.device),
        p.dtype,
        arch,
        |v| {
            matches!(v.name, "wgmma" | "fused")
                .then(|| cuda::wgmma_unfit(p))
                .flatten()
        },
    )?;
    Ok(v.name)
}

/// The layer's forward, into new buffers.
pub fn moe_forward(
    x: &Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
    opts: &MoeOptions,
) -> Result<MoeForward> {
    let p = validate(x, w, cfg)?;
    let f = MoeForward::alloc(&p, opts.stream.as_ref())?;
    moe_forward_into(x, w, cfg, &f, opts)?;
    Ok(f)
}

/// The layer's forward into caller-provided buffers (`MoeForward::alloc` / `from_buffers`).
pub fn moe_forward_into(
    x: &Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
    f: &MoeForward,
    opts: &MoeOptions,
) -> Result<()> {
    let p = validate(x, w, cfg)?;
    if p != f.problem {
        return Err(Error::bad_arg(
            OP,
            "f",
            format!("buffers for {}", p.label()),
            f.problem.label(),
        ));
    }
    for t in f.fields() {
        if [x, w.router, w.w_up, w.w_down]
            .iter()
            .any(|i| t.shares_storage(i))
        {
            return Err(Error::bad_arg(
                OP,
                "f",
                "buffers distinct from the inputs",
                "a view of one",
            ));
        }
    }
    let v = select(&p, opts.variant.as_deref())?;
    f.backward_ready
        .store(false, std::sync::atomic::Ordering::Relaxed);
    match p.device {
        Device::Cpu => cpu::forward(v, &p, x, w, cfg, f)?,
        Device::Cuda(_) => cuda::forward(v, &p, x, w, cfg, f, opts)?,
    }
    f.backward_ready
        .store(!opts.forward_only, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

fn not_ready() -> Error {
    Error::bad_arg(
        OP,
        "fwd",
        "the state of a finished forward run without forward_only, not yet used by a backward",
        "a forward_only, unfinished or already back-propagated forward (one backward per forward: \
         it writes its gradients over the saved pre-activations)",
    )
}

/// The layer's backward: dout `[T, H]` → dx, d_router, dw_up, dw_down (the auxiliary and
/// z-losses' gradients included, with the coefficients of `cfg`). One backward per forward:
/// the CUDA path writes the pre-activations' gradient over `fwd.hpre` (the backward's largest
/// buffer not allocated a second time), so a second backward of the same state is refused.
pub fn moe_backward(
    dout: &Tensor,
    x: &Tensor,
    w: &MoeWeights,
    fwd: &MoeForward,
    cfg: &MoeConfig,
    opts: &MoeOptions,
) -> Result<MoeGrads> {
    let p = validate(x, w, cfg)?;
    if p != fwd.problem {
        return Err(Error::bad_arg(
            OP,
            "fwd",
            format!("the forward of this call ({})", p.label()),
            fwd.problem.label(),
        ));
    }
    let g = MoeGrads::alloc(&p, opts.stream.as_ref())?;
    moe_backward_into(dout, x, w, fwd, cfg, &g, None, opts)?;
    Ok(g)
}

/// The layer's backward into caller-provided gradient buffers. `loss_grad` (f32, at least 2
/// elements, on the layer's device): the incoming gradients of the aux loss and the z-loss, which
/// scale their terms (None: 1 each) — read on the device, so a captured step needs no host value.
#[allow(clippy::too_many_arguments)]
pub fn moe_backward_into(
    dout: &Tensor,
    x: &Tensor,
    w: &MoeWeights,
    fwd: &MoeForward,
    cfg: &MoeConfig,
    g: &MoeGrads,
    loss_grad: Option<&Tensor>,
    opts: &MoeOptions,
) -> Result<()> {
    if let Some(l) = loss_grad {
        if l.dtype() != DType::F32
            || l.numel() < 2
            || !l.is_contiguous()
            || l.device() != x.device()
        {
            return Err(Error::bad_arg(
                OP,
                "loss_grad",
                format!("a contiguous f32 tensor of ≥ 2 elements on {}", x.device()),
                describe(l),
            ));
        }
    }
    if !fwd
        .backward_ready
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return Err(not_ready());
    }
    let p = validate(x, w, cfg)?;
    if p != fwd.problem {
        return Err(Error::bad_arg(
            OP,
            "fwd",
            format!("the forward of this call ({})", p.label()),
            fwd.problem.label(),
        ));
    }
    expect(dout, "dout", &[p.tokens, p.hidden], p.dtype, p.device)?;
    let mut ins: Vec<&Tensor> = vec![dout, x, w.router, w.w_up, w.w_down];
    ins.extend(fwd.fields());
    g.check(&p, &ins)?;
    let v = select(&p, opts.variant.as_deref())?;
    // The backward consumes the state (its gradient is written over hpre): claimed once, after
    // every check, so a refused call leaves it usable.
    if !fwd
        .backward_ready
        .swap(false, std::sync::atomic::Ordering::Relaxed)
    {
        return Err(not_ready());
    }
    match p.device {
        Device::Cpu => cpu::backward(v, &p, dout, x, w, fwd, cfg, loss_grad, g),
        Device::Cuda(_) => cuda::backward(v, &p, dout, x, w, fwd, cfg, g, loss_grad, opts),
    }
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Moe;

impl OpFamily for Moe {
    fn name(&self) -> &'static str {
        OP
    }
    fn variants(&self) -> Vec<VariantInfo> {
        variants()
    }
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
        check::run(cfg, out)
    }
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()> {
        bench::run(cfg, ceilings, progress, out)
    }
    fn bench_takes_size(&self) -> bool {
        false
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
