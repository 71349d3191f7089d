//! CUDA host code of the moe family: the routing / layout / combine kernels of kernels/moe.cu and
//! the expert GEMMs, as a loop of matmul calls (`naive`) or matmul's grouped kernels (`grouped`:
//! mma.sync, `wgmma`: Hopper's persistent TMA kernel; `fused`: `wgmma` with the GLU in the up
//! projection's epilogue).

use super::{MoeConfig, MoeForward, MoeGrads, MoeOptions, MoeWeights, Problem};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{KernelSpec, Precision};
use crate::core::tensor::Tensor;
use crate::kernel_source;
use crate::ops::activation::{self, GluOptions};
use crate::ops::matmul::cuda::{self as mm, Grouping, Groups, Ptrs};
use crate::ops::matmul::{self, Gemm, MatmulOptions, Operand};
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("moe", "kernels/moe.cu");
const FUNCS: [&str; 21] = [
    "moe_router",
    "moe_fill_i32",
    "moe_zero_bytes",
    "moe_chunk_hist",
    "moe_plan",
    "moe_scatter",
    "moe_spread_rows",
    "moe_combine",
    "moe_glu_bwd_0",
    "moe_glu_bwd_1",
    "moe_glu_bwd_2",
    "moe_glu_bwd_3",
    "moe_glu_bwd_4",
    "moe_unpermute_grad",
    "moe_router_bwd",
    "moe_stats_partial",
    "moe_stats_final",
    "moe_ep_seg_sizes",
    "moe_ep_gather_f32",
    "moe_iota",
    "moe_ep_gather_rows",
];
/// kernels/moe.cu's CHUNK and SCATTER_THREADS.
const CHUNK: usize = 2048;
const SCATTER_WARPS: usize = 8;
/// Tokens per block of moe_stats_partial.
const STATS_ROWS: usize = 256;

pub fn program(dtype: DType) -> Program {
    Program::new(SRC).define("FE_ELEM", dtype.cuda_name())
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .map(|d| KernelSpec {
            program: program(d),
            functions: FUNCS.iter().map(|s| s.to_string()).collect(),
            min_arch: Arch::SM80,
        })
        .collect()
}

/// Why `wgmma` cannot run `p`, if it cannot: TMA needs 16-byte aligned rows.
pub fn wgmma_unfit(p: &Problem) -> Option<String> {
    let es = p.dtype.size_in_bytes();
    (!(p.hidden * es).is_multiple_of(16) || !(p.inter * es).is_multiple_of(16)).then(|| {
        format!(
            "needs hidden and inter multiples of {} (16-byte rows for TMA), got {} and {}",
            16 / es,
            p.hidden,
            p.inter
        )
    })
}

/// The device, stream and kernel module of one call.
pub(crate) struct Ctx {
    dev: Arc<CudaDevice>,
    stream: Stream,
    program: Program,
}

impl Ctx {
    /// Waits for the call's stream (before another stream or the host reads what it wrote).
    pub(crate) fn sync(&self) -> Result<()> {
        self.dev.synchronize(&self.stream, "moe")
    }

    /// The module of `dtype` on `dev`, launching on `stream`.
    pub(crate) fn on(dev: Arc<CudaDevice>, stream: Stream, dtype: DType) -> Ctx {
        Ctx {
            dev,
            stream,
            program: program(dtype),
        }
    }

    pub(crate) fn new(p: &Problem, opts: &MoeOptions) -> Result<Ctx> {
        let Device::Cuda(i) = p.device else {
            return Err(Error::Other("moe::cuda on a CPU problem".into()));
        };
        let dev = device(i)?;
        let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
        Ok(Ctx {
            dev,
            stream,
            program: program(p.dtype),
        })
    }

    pub(crate) fn launch(
        &self,
        f: &str,
        grid: u32,
        block: u32,
        smem: u32,
        args: &mut KernelArgs,
    ) -> Result<()> {
        let k = self.dev.kernel(&self.program, f)?;
        if smem > 48 * 1024 {
            k.allow_dynamic_smem(smem)?;
        }
        k.launch(&self.stream, (grid.max(1), 1, 1), (block, 1, 1), smem, args)
    }

    /// A grid-stride kernel's block count for `work` items of `per_block`.
    pub(crate) fn grid(&self, work: usize, per_block: usize) -> u32 {
        let most = self.dev.props().sm_count as usize * 16;
        work.div_ceil(per_block.max(1)).clamp(1, most) as u32
    }

    /// A workspace in stream order on the call's stream.
    pub(crate) fn empty(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::empty_on(shape, dtype, &self.dev, &self.stream)
    }

    fn fill_i32(&self, t: &Tensor, v: i32) -> Result<()> {
        let n = t.numel();
        let mut a = KernelArgs::new();
        a.push(t.device_ptr()?).push(n as i64).push(v);
        self.launch("moe_fill_i32", self.grid(n, 256), 256, 0, &mut a)
    }

    pub(crate) fn zero(&self, t: &Tensor) -> Result<()> {
        let n = t.nbytes();
        let mut a = KernelArgs::new();
        a.push(t.device_ptr()?).push(n as i64);
        self.launch("moe_zero_bytes", self.grid(n, 1024), 256, 0, &mut a)
    }

    fn router_opts(&self) -> MatmulOptions {
        MatmulOptions {
            precision: Precision::F32,
            ..self.matmul_opts()
        }
    }

    fn matmul_opts(&self) -> MatmulOptions {
        MatmulOptions {
            stream: Some(self.stream.clone()),
            precision: Precision::Tf32,
            ..Default::default()
        }
    }
}

/// The grouped kernel a variant runs (None: `naive`'s loop of matmul calls).
fn grouped_kernel(variant: &str) -> Option<&'static str> {
    match variant {
        "grouped" => Some("mma_pipelined"),
        "wgmma" | "fused" => Some("wgmma"),
        _ => None,
    }
}

/// The whole launch of a grouped GEMM over `e` groups: M-grouped `c[rows] = a[rows]·op(b[g])`
/// (a `[m, k]` row-major, b `[e, k, n]`, or `[e, n, k]` read transposed when `bt`, c `[m, n]`),
/// or K-grouped `c[g] = a[rows of g]ᵀ·b[rows of g]` (a `[k, m]`, b `[k, n]`, c `[e, m, n]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_gemm(
    mode: Grouping,
    e: usize,
    (m, n, k): (usize, usize, usize),
    bt: bool,
    dtype: DType,
    device: Device,
) -> Gemm {
    let op = |ld, trans, batch_stride| Operand {
        ld,
        trans,
        batch_stride,
    };
    let (a, b, c) = match mode {
        Grouping::M => (
            op(k, false, 0),
            op(if bt { k } else { n }, bt, k * n),
            op(n, false, 0),
        ),
        Grouping::K => (op(m, true, 0), op(n, false, 0), op(n, false, m * n)),
    };
    Gemm {
        batch: e,
        m,
        n,
        k,
        a,
        b,
        c,
        dtype,
        device,
    }
}

/// The padded expert-contiguous rows an expert stage walks: `rows` rows of buffer, `experts`
/// segments ending at `ends` (int32 on the device), and the host's copy of the ends when it has
/// one (`naive` needs it; an expert-parallel layer always has it).
#[derive(Clone, Copy)]
pub(crate) struct Segs<'a> {
    pub rows: usize,
    pub experts: usize,
    pub ends: &'a Tensor,
    pub host: Option<&'a [i32]>,
}

impl Segs<'_> {
    /// Rows in use: the last end when the host knows it, else the whole buffer (rows past the
    /// used ones are never read).
    fn used(&self) -> usize {
        self.host
            .and_then(|v| v.last())
            .map_or(self.rows, |&u| u as usize)
    }
}

/// One expert GEMM over every segment of `s`: M-grouped `c[rows] = a[rows]·op(b[e])`
/// (b `[E, k, n]`, or `[E, n, k]` read transposed when `bt`), or K-grouped `c[e] =
/// a[rows of e]ᵀ·b[rows of e]` (a `[rows, m]`, b `[rows, n]`, c `[E, m, n]`).
#[allow(clippy::too_many_arguments)]
fn expert_gemm(
    x: &Ctx,
    variant: &str,
    mode: Grouping,
    p: &Problem,
    (m, n, k): (usize, usize, usize),
    a: &Tensor,
    b: &Tensor,
    bt: bool,
    c: &Tensor,
    s: Segs,
) -> Result<()> {
    let e = s.experts;
    if let Some(kind) = grouped_kernel(variant) {
        let g = grouped_gemm(mode, e, (m, n, k), bt, p.dtype, p.device);
        let l = mm::plan_grouped(kind, &g, mode, &x.dev)?;
        let ptrs = Ptrs {
            a: a.device_ptr()?,
            b: b.device_ptr()?,
            c: c.device_ptr()?,
        };
        let groups = Groups {
            mode,
            ends: s.ends.device_ptr()?,
            groups: e,
        };
        return mm::launch_grouped(&l, &g, ptrs, groups, 1.0, 0.0, &x.stream);
    }
    // naive: one matmul call per expert, sized from the host's copy of the ends.
    let ends = s
        .host
        .ok_or_else(|| Error::Other("moe naive: ends not on the host".into()))?;
    let opts = x.matmul_opts();
    for ex in 0..e {
        let s = if ex > 0 { ends[ex - 1] as usize } else { 0 };
        let len = ends[ex] as usize - s;
        match mode {
            Grouping::M => {
                if len == 0 {
                    continue;
                }
                let ae = a.narrow(0, s, len)?;
                let be = b.narrow(0, ex, 1)?;
                let be = if bt {
                    be.reshape(&[n, k])?.t()?
                } else {
                    be.reshape(&[k, n])?
                };
                matmul::matmul_into(&ae, &be, &c.narrow(0, s, len)?, &opts)?;
            }
            Grouping::K => {
                let ce = c.narrow(0, ex, 1)?.reshape(&[m, n])?;
                if len == 0 {
                    x.zero(&ce)?;
                    continue;
                }
                let ae = a.narrow(0, s, len)?.t()?;
                let be = b.narrow(0, s, len)?;
                matmul::matmul_into(&ae, &be, &ce, &opts)?;
            }
        }
    }
    Ok(())
}

/// The routing and layout steps shared by every variant (logits, router, plan, scatter,
/// gather), into the forward's buffers.
pub(crate) fn route(
    x: &Ctx,
    p: &Problem,
    xt: &Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
    f: &MoeForward,
) -> Result<()> {
    let (t, e, k) = (p.tokens, p.experts, p.top_k);
    // The router's GEMMs in full precision for f32 layers: tf32's 10-bit products can reorder
    // close logits, and they are a sliver of the layer's FLOPs.
    matmul::matmul_into(xt, &w.router.t()?, &f.logits, &x.router_opts())?;
    let mut a = KernelArgs::new();
    a.push(f.logits.device_ptr()?)
        .push(e as i64)
        .push(t as i32)
        .push(e as i32)
        .push(k as i32)
        .push(cfg.score.code())
        .push(cfg.renormalize as i32)
        .push(cfg.groups as i32)
        .push(cfg.topk_groups as i32)
        .push(cfg.routed_scale)
        .push(f.idx.device_ptr()?)
        .push(f.weights.device_ptr()?)
        .push(f.probs.device_ptr()?)
        .push(f.lse.device_ptr()?);
    x.launch(
        "moe_router",
        x.grid(t, 4),
        128,
        (4 * 2 * e * 4) as u32,
        &mut a,
    )?;

    let pairs = t * k;
    let chunks = pairs.div_ceil(CHUNK);
    let hist = x.empty(&[chunks, e], DType::I32)?;
    let base = x.empty(&[chunks, e], DType::I32)?;
    x.fill_i32(&f.src, -1)?;
    let mut a = KernelArgs::new();
    a.push(f.idx.device_ptr()?)
        .push(pairs as i64)
        .push(e as i32)
        .push(hist.device_ptr()?);
    // One block per chunk (not grid-stride): chunk c's histogram is row c.
    x.launch("moe_chunk_hist", chunks as u32, 256, (e * 4) as u32, &mut a)?;
    let cap = cfg
        .capacity(t)
        .map_or(-1, |c| c.min(i32::MAX as usize) as i32);
    let mut a = KernelArgs::new();
    a.push(hist.device_ptr()?)
        .push(chunks as i32)
        .push(e as i32)
        .push(cap)
        .push(base.device_ptr()?)
        .push(f.counts.device_ptr()?)
        .push(f.ends.device_ptr()?)
        .push(f.stats.device_ptr()?);
    x.launch("moe_plan", 1, 1024, 0, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(f.idx.device_ptr()?)
        .push(pairs as i64)
        .push(e as i32)
        .push(base.device_ptr()?)
        .push(f.ends.device_ptr()?)
        .push(cap)
        .push(f.pos.device_ptr()?)
        .push(f.src.device_ptr()?);
    let smem = (e * (SCATTER_WARPS + 1) * 4) as u32;
    x.launch("moe_scatter", chunks as u32, 256, smem, &mut a)?;
    spread_rows(x, p, xt, f, &f.xp)
}

/// `dst[pos[t, j]] = rows[t]` for every kept slot, zeros on the padding rows (kernels/moe.cu's
/// moe_spread_rows): x into the layout (forward), dout into it (backward).
pub(crate) fn spread_rows(
    x: &Ctx,
    p: &Problem,
    rows: &Tensor,
    f: &MoeForward,
    dst: &Tensor,
) -> Result<()> {
    let (pr, pd) = (rows.device_ptr()?, dst.device_ptr()?);
    let mut a = KernelArgs::new();
    a.push(pr)
        .push(p.hidden as i64)
        .push(f.pos.device_ptr()?)
        .push(p.top_k as i32)
        .push(p.tokens as i32)
        .push(f.src.device_ptr()?)
        .push(f.ends.device_ptr()?)
        .push(p.experts as i32)
        .push(rows_vec(p, &[pr, pd]) as i32)
        .push(pd);
    x.launch("moe_spread_rows", x.grid(p.rows_cap(), 8), 256, 0, &mut a)
}

/// Whether rows of H elements at these bases can move as 16-byte vectors.
fn rows_vec(p: &Problem, ptrs: &[u64]) -> bool {
    (p.hidden * p.dtype.size_in_bytes()).is_multiple_of(16)
        && ptrs.iter().all(|q| q.is_multiple_of(16))
}

/// The host's copy of the ends (`naive` only: waits for the device).
fn host_ends(variant: &str, ends: &Tensor) -> Result<Option<Vec<i32>>> {
    if grouped_kernel(variant).is_some() {
        Ok(None)
    } else {
        ends.to_vec::<i32>().map(Some)
    }
}

pub fn forward(
    variant: &str,
    p: &Problem,
    xt: &Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
    f: &MoeForward,
    opts: &MoeOptions,
) -> Result<()> {
    let x = Ctx::new(p, opts)?;
    route(&x, p, xt, w, cfg, f)?;
    let he = host_ends(variant, &f.ends)?;
    let s = Segs {
        rows: p.rows_cap(),
        experts: p.experts,
        ends: &f.ends,
        host: he.as_deref(),
    };
    let y = experts_forward(
        &x,
        variant,
        p,
        s,
        (&f.xp, &f.hpre),
        w,
        cfg,
        !opts.forward_only,
    )?;
    combine(&x, p, cfg, f, &y)
}

/// The experts' half of the forward over the rows of `s`: up projection of `xp` into `hpre`
/// (`fused`: the GLU from the same accumulators, `hpre` only when `keep_pre`), the GLU, and the
/// down projection; returns the experts' outputs `y` `[s.rows, H]` (a workspace in stream order).
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts_forward(
    x: &Ctx,
    variant: &str,
    p: &Problem,
    s: Segs,
    (xp, hpre): (&Tensor, &Tensor),
    w: &MoeWeights,
    cfg: &MoeConfig,
    keep_pre: bool,
) -> Result<Tensor> {
    // The GLU output is the forward's own workspace (the backward recomputes it from `hpre`):
    // back to the pool, in stream order, once the down projection has read it.
    let a = x.empty(&[s.rows, p.inter], p.dtype)?;
    let y = x.empty(&[s.rows, p.hidden], p.dtype)?;
    up_proj(x, variant, p, s, (xp, hpre), w.w_up, cfg, &a, keep_pre)?;
    if variant != "fused" {
        glu(x, s, cfg, hpre, &a)?;
    }
    down_proj(x, variant, p, s, &a, w.w_down, &y)?;
    Ok(y)
}

/// `out[t] = Σ_j w[t,j]·y[pos[t,j]]`, then the losses.
pub(crate) fn combine(
    x: &Ctx,
    p: &Problem,
    cfg: &MoeConfig,
    f: &MoeForward,
    y: &Tensor,
) -> Result<()> {
    let (py, po) = (y.device_ptr()?, f.out.device_ptr()?);
    let mut args = KernelArgs::new();
    args.push(py)
        .push(p.hidden as i64)
        .push(f.pos.device_ptr()?)
        .push(f.weights.device_ptr()?)
        .push(p.top_k as i32)
        .push(p.tokens as i32)
        .push(rows_vec(p, &[py, po]) as i32)
        .push(po);
    x.launch("moe_combine", x.grid(p.tokens, 1), 256, 0, &mut args)?;
    stats(x, p, cfg, f)
}

/// `a = act(gate) ⊙ up` of the up projection over the used rows of `s`.
fn glu(x: &Ctx, s: Segs, cfg: &MoeConfig, hpre: &Tensor, a: &Tensor) -> Result<()> {
    let used = s.used();
    if used == 0 {
        return Ok(());
    }
    activation::glu_into(
        &hpre.narrow(0, 0, used)?,
        &a.narrow(0, 0, used)?,
        &GluOptions {
            act: cfg.act,
            stream: Some(x.stream.clone()),
            variant: None,
        },
    )
}

/// The up projection of every expert: `hpre = xp·W_up[e]` over the rows of `s` (`fused`:
/// `a = act(gate) ⊙ up` from the same accumulators, and `hpre` only when `keep_pre`).
#[allow(clippy::too_many_arguments)]
fn up_proj(
    x: &Ctx,
    variant: &str,
    p: &Problem,
    s: Segs,
    (xp, hpre): (&Tensor, &Tensor),
    w_up: &Tensor,
    cfg: &MoeConfig,
    a: &Tensor,
    keep_pre: bool,
) -> Result<()> {
    let dims = (s.rows, 2 * p.inter, p.hidden);
    if variant == "fused" {
        let mut g = grouped_gemm(Grouping::M, s.experts, dims, false, p.dtype, p.device);
        g.c.ld = p.inter;
        let l = mm::plan_grouped_glu(&g, cfg.act, &x.dev)?;
        let ptrs = Ptrs {
            a: xp.device_ptr()?,
            b: w_up.device_ptr()?,
            c: a.device_ptr()?,
        };
        let groups = Groups {
            mode: Grouping::M,
            ends: s.ends.device_ptr()?,
            groups: s.experts,
        };
        return mm::launch_grouped_glu(
            &l,
            &g,
            ptrs,
            keep_pre.then(|| hpre.device_ptr()).transpose()?,
            groups,
            &x.stream,
        );
    }
    expert_gemm(x, variant, Grouping::M, p, dims, xp, w_up, false, hpre, s)
}

/// The down projection of every expert: `y = a·W_down[e]` over the rows of `s`.
fn down_proj(
    x: &Ctx,
    variant: &str,
    p: &Problem,
    s: Segs,
    a: &Tensor,
    w_down: &Tensor,
    y: &Tensor,
) -> Result<()> {
    let dims = (s.rows, p.hidden, p.inter);
    expert_gemm(x, variant, Grouping::M, p, dims, a, w_down, false, y, s)
}

/// The forward's two expert GEMMs alone (up into `hpre` — `fused`: and the GLU output — down
/// from the GLU output) on the layout of a finished forward `f`, with the workspaces of
/// `ExpertGemms::new`: what `bench` sets against a dense GEMM chain of the same FLOPs.
pub struct ExpertGemms {
    a: Tensor,
    y: Tensor,
}

impl ExpertGemms {
    pub fn new(p: &Problem, opts: &MoeOptions) -> Result<ExpertGemms> {
        let x = Ctx::new(p, opts)?;
        let r = p.rows_cap();
        Ok(ExpertGemms {
            a: x.empty(&[r, p.inter], p.dtype)?,
            y: x.empty(&[r, p.hidden], p.dtype)?,
        })
    }

    pub fn run(
        &self,
        variant: &str,
        p: &Problem,
        w: &MoeWeights,
        cfg: &MoeConfig,
        f: &MoeForward,
        opts: &MoeOptions,
    ) -> Result<()> {
        let x = Ctx::new(p, opts)?;
        let he = host_ends(variant, &f.ends)?;
        let s = Segs {
            rows: p.rows_cap(),
            experts: p.experts,
            ends: &f.ends,
            host: he.as_deref(),
        };
        up_proj(
            &x,
            variant,
            p,
            s,
            (&f.xp, &f.hpre),
            w.w_up,
            cfg,
            &self.a,
            true,
        )?;
        down_proj(&x, variant, p, s, &self.a, w.w_down, &self.y)
    }
}

/// The auxiliary and z-losses and each expert's mean score (`[2 + E]` f32), deterministic.
fn stats(x: &Ctx, p: &Problem, cfg: &MoeConfig, r: &MoeForward) -> Result<()> {
    let (t, e) = (p.tokens, p.experts);
    let blocks = t.div_ceil(STATS_ROWS);
    let part = x.empty(&[blocks, e + 1], DType::F32)?;
    let mut a = KernelArgs::new();
    a.push(r.probs.device_ptr()?)
        .push(r.lse.device_ptr()?)
        .push(t as i32)
        .push(e as i32)
        .push(STATS_ROWS as i32)
        .push(part.device_ptr()?);
    x.launch("moe_stats_partial", blocks as u32, 256, 0, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(part.device_ptr()?)
        .push(blocks as i32)
        .push(e as i32)
        .push(r.counts.device_ptr()?)
        .push(t as i32)
        .push(p.top_k as i32)
        .push(cfg.aux_loss_coef)
        .push(cfg.z_loss_coef)
        .push(r.losses.device_ptr()?);
    x.launch("moe_stats_final", 1, 256, 0, &mut a)
}

#[allow(clippy::too_many_arguments)]
pub fn backward(
    variant: &str,
    p: &Problem,
    dout: &Tensor,
    xt: &Tensor,
    w: &MoeWeights,
    f: &MoeForward,
    cfg: &MoeConfig,
    gr: &MoeGrads,
    loss_grad: Option<&Tensor>,
    opts: &MoeOptions,
) -> Result<()> {
    let x = Ctx::new(p, opts)?;
    let he = host_ends(variant, &f.ends)?;
    let s = Segs {
        rows: p.rows_cap(),
        experts: p.experts,
        ends: &f.ends,
        host: he.as_deref(),
    };
    // dout's rows in the layout, unscaled (zeros on padding).
    let dyu = x.empty(&[s.rows, p.hidden], p.dtype)?;
    spread_rows(&x, p, dout, f, &dyu)?;
    let dw = x.empty(&[p.tokens * p.top_k], DType::F32)?;
    x.zero(&dw)?;
    let dxp = experts_backward(
        &x,
        variant,
        p,
        s,
        ExpertGrads {
            dyu,
            xp: &f.xp,
            hpre: &f.hpre,
            src: &f.src,
            weights: &f.weights,
            dw: &dw,
            dw_up: &gr.dw_up,
            dw_down: &gr.dw_down,
        },
        w,
        cfg,
    )?;
    router_backward(&x, p, xt, w.router, f, cfg, (&dxp, &dw), gr, loss_grad)
}

/// What the experts' backward reads and writes: `dyu` (dout's rows in the layout, unscaled,
/// zeros on padding; consumed), the forward's `xp` and `hpre` (consumed: its gradient is written
/// over it), each row's pair `src` (< 0: padding) and the pairs' gate `weights`; out: the gates'
/// gradients `dw` (per pair, f32) and the experts' weight gradients.
pub(crate) struct ExpertGrads<'a> {
    pub dyu: Tensor,
    pub xp: &'a Tensor,
    pub hpre: &'a Tensor,
    pub src: &'a Tensor,
    pub weights: &'a Tensor,
    pub dw: &'a Tensor,
    pub dw_up: &'a Tensor,
    pub dw_down: &'a Tensor,
}

/// The experts' half of the backward over the rows of `s` (w: the experts' `w_up`/`w_down`);
/// returns dxp = dhpre·W_upᵀ `[s.rows, H]` (a workspace in stream order).
pub(crate) fn experts_backward(
    x: &Ctx,
    variant: &str,
    p: &Problem,
    s: Segs,
    g: ExpertGrads,
    w: &MoeWeights,
    cfg: &MoeConfig,
) -> Result<Tensor> {
    let (h, i, rows) = (p.hidden, p.inter, s.rows);
    // gu = dyu·W_downᵀ.
    let gu = x.empty(&[rows, i], p.dtype)?;
    expert_gemm(
        x,
        variant,
        Grouping::M,
        p,
        (rows, i, h),
        &g.dyu,
        w.w_down,
        true,
        &gu,
        s,
    )?;
    // The GLU backward with the gates folded in: dhpre, s·a (dW_down's operand, written over gu
    // in place) and the gates' gradients, from hpre and gu (kernels/moe.cu, moe_glu_bwd). dhpre
    // is written over hpre (each element read, then written, by the same thread): nothing reads
    // the pre-activations after this kernel, and a second [rows, 2I] buffer would be the
    // backward's largest workspace (0.97 GB at the Mixtral-like shape) at its peak, when dxp is
    // allocated.
    let dhpre = g.hpre;
    let wa = gu;
    let (pgu, php, pdh) = (wa.device_ptr()?, g.hpre.device_ptr()?, dhpre.device_ptr()?);
    let vec = (i * p.dtype.size_in_bytes()).is_multiple_of(16)
        && [pgu, php, pdh].iter().all(|q| q.is_multiple_of(16));
    let mut a = KernelArgs::new();
    a.push(pgu)
        .push(php)
        .push(i as i64)
        .push(g.src.device_ptr()?)
        .push(g.weights.device_ptr()?)
        .push(s.ends.device_ptr()?)
        .push(s.experts as i32)
        .push(vec as i32)
        .push(pdh)
        .push(pgu)
        .push(g.dw.device_ptr()?);
    let glu_bwd = format!("moe_glu_bwd_{}", cfg.act.code());
    x.launch(&glu_bwd, x.grid(rows, 8), 256, 0, &mut a)?;
    // Workspaces go back to the pool (in stream order) as soon as the last kernel reading them
    // is queued, so the next ones reuse the memory.
    // dW_down[e] = (s·a)_eᵀ·dyu_e.
    expert_gemm(
        x,
        variant,
        Grouping::K,
        p,
        (i, h, rows),
        &wa,
        &g.dyu,
        false,
        g.dw_down,
        s,
    )?;
    drop(wa);
    drop(g.dyu);
    // Up projection: dxp = dhpre·W_upᵀ, dW_up[e] = xp_eᵀ·dhpre_e.
    let dxp = x.empty(&[rows, h], p.dtype)?;
    expert_gemm(
        x,
        variant,
        Grouping::M,
        p,
        (rows, h, 2 * i),
        dhpre,
        w.w_up,
        true,
        &dxp,
        s,
    )?;
    expert_gemm(
        x,
        variant,
        Grouping::K,
        p,
        (h, 2 * i, rows),
        g.xp,
        dhpre,
        false,
        g.dw_up,
        s,
    )?;
    Ok(dxp)
}

/// The routing's half of the backward: dx = `Σ_j dxp[pos]` + dlogits·router, d_router =
/// dlogitsᵀ·x, dlogits from the gates' gradients `dw` and the losses.
#[allow(clippy::too_many_arguments)]
pub(crate) fn router_backward(
    x: &Ctx,
    p: &Problem,
    xt: &Tensor,
    router: &Tensor,
    f: &MoeForward,
    cfg: &MoeConfig,
    (dxp, dw): (&Tensor, &Tensor),
    gr: &MoeGrads,
    loss_grad: Option<&Tensor>,
) -> Result<()> {
    let (t, h, e, k) = (p.tokens, p.hidden, p.experts, p.top_k);
    let dx = &gr.dx;
    let (pd, px) = (dxp.device_ptr()?, dx.device_ptr()?);
    let mut a = KernelArgs::new();
    a.push(pd)
        .push(h as i64)
        .push(f.pos.device_ptr()?)
        .push(k as i32)
        .push(t as i32)
        .push(rows_vec(p, &[pd, px]) as i32)
        .push(px);
    x.launch("moe_unpermute_grad", x.grid(t, 1), 256, 0, &mut a)?;
    let dlogits = x.empty(&[t, e], p.dtype)?;
    let mut a = KernelArgs::new();
    a.push(dw.device_ptr()?)
        .push(f.idx.device_ptr()?)
        .push(f.probs.device_ptr()?)
        .push(f.lse.device_ptr()?)
        .push(f.logits.device_ptr()?)
        .push(e as i64)
        .push(f.counts.device_ptr()?)
        .push(t as i32)
        .push(e as i32)
        .push(k as i32)
        .push(cfg.score.code())
        .push(cfg.renormalize as i32)
        .push(cfg.routed_scale)
        .push(cfg.aux_loss_coef)
        .push(cfg.z_loss_coef)
        .push(loss_grad.map_or(Ok(0), |t| t.device_ptr())?)
        .push(dlogits.device_ptr()?)
        .push(e as i64);
    x.launch(
        "moe_router_bwd",
        x.grid(t, 4),
        128,
        (4 * e * 4) as u32,
        &mut a,
    )?;
    let mo = x.router_opts();
    matmul::matmul_into(
        &dlogits,
        router,
        dx,
        &MatmulOptions {
            beta: 1.0,
            ..mo.clone()
        },
    )?;
    matmul::matmul_into(&dlogits.t()?, xt, &gr.d_router, &mo)
}
