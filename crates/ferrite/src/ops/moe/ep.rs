//! Expert parallelism: one layer's experts spread over the ranks of a process group, tokens sent
//! to the rank that owns their expert and the experts' outputs sent back.
//!
//! Rank r of W owns experts `r·E/W .. (r+1)·E/W` (`w_up`/`w_down` hold only those) and routes its
//! own tokens with the whole (replicated) router. A forward, per rank:
//! 1. **route** its tokens exactly as the one-GPU layer does (router, top-k, capacity, the padded
//!    expert-contiguous layout `xp`): expert e's rows are one padded segment, and the experts of
//!    rank d are consecutive, so what goes to d is a run of whole segments;
//! 2. **exchange the segment sizes on the device** (an all-to-all of `E/W` int32 per peer), then
//!    read them, with this rank's own layout ends, in one device→host copy: NCCL's receives need
//!    their sizes on the host, and this is the layer's only host synchronisation;
//! 3. **dispatch**: an all-to-all of the segments (NCCL grouped send/recv, one contiguous run per
//!    peer — the destination's experts are consecutive in the layout — padding rows included so
//!    every received segment stays a multiple of 128 rows) and of each row's gate weight; the
//!    owner moves the rows from their order of arrival (by sending rank) to expert-major order
//!    (`[expert j: from rank 0 | from rank 1 | …]`, again a padded expert-contiguous layout) with
//!    one row gather (one NCCL send per peer instead of one per expert segment: at 128 experts,
//!    per-segment sends made the exchanges slower than the experts' GEMMs);
//! 4. **experts**: the one-GPU layer's expert stage (grouped up projection, GLU, grouped down
//!    projection; the variant chosen for the local experts) over the received rows;
//! 5. **return** the outputs by the reverse all-to-all into this rank's layout, and **combine**
//!    (`out[t] = Σ_j w[t,j]·y[pos[t,j]]`) and the losses as the layer does.
//!
//! The backward runs the same way: dout spread into the layout, dispatched, the experts' backward
//! on the owner (the gate weights it received fold in as in the one-GPU kernel, and each row's
//! gate gradient comes from the same GEMM), dX rows and gate gradients returned, then the router's
//! backward on the routing rank. Each rank's expert weight gradients cover every rank's tokens
//! routed to its experts; the router's gradient covers this rank's tokens (the router is
//! replicated: sum it over the ranks as for any data-parallel weight).
//!
//! Semantics per rank are those of `moe_forward` on that rank's tokens — capacity is
//! `ceil(T_r·k/E·factor)` of the rank's own T_r, the losses are the rank's — so a rank's output
//! equals the one-GPU layer's on its tokens.

use super::{
    cpu, cuda, expect, select, MoeConfig, MoeForward, MoeGrads, MoeOptions, MoeWeights, Problem, OP,
};
use crate::core::cuda::KernelArgs;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::{describe, Tensor};
use crate::dist::{Chunks, ProcessGroup};

/// This rank's part of an expert-parallel layer: the run's configuration, checked the same on
/// every rank when made.
pub struct ExpertParallel<'g> {
    pg: &'g ProcessGroup,
    cfg: MoeConfig,
    hidden: usize,
    inter: usize,
    dtype: DType,
    device: Device,
    /// Per-phase wall times of the calls since `profile_phases(true)` (each phase waited for).
    phases: std::cell::RefCell<Option<(std::time::Instant, Vec<(&'static str, f64)>)>>,
}

impl std::fmt::Debug for ExpertParallel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallel(rank {} of {}, experts {:?} of {})",
            self.pg.rank(),
            self.pg.world(),
            self.experts(),
            self.cfg.experts
        )
    }
}

/// Which rows move where: per peer, the `(first row, rows)` run of the routing rank's layout
/// (`to`) and of the owner's arrival buffer (`from`); the local experts' ends in expert-major
/// order; `order[r]`: the arrival row of expert-major row r, `back` its inverse.
struct Plan {
    to: Vec<Chunks>,
    from: Vec<Chunks>,
    ends: Vec<i32>,
    rows: usize,
    order: Vec<i32>,
    back: Vec<i32>,
}

/// A plan's row orders on the layer's device (int32).
struct Maps {
    order: Tensor,
    back: Tensor,
}

/// `out[r] = src[map[r]]` (rows of a contiguous `[n, …]` tensor; `host_map` is `map`'s values).
fn reorder(
    ctx: Option<&cuda::Ctx>,
    src: &Tensor,
    map: &Tensor,
    host_map: &[i32],
) -> Result<Tensor> {
    match ctx {
        Some(c) => {
            let out = c.empty(src.shape(), src.dtype())?;
            c.gather_rows(src, map, &out)?;
            Ok(out)
        }
        None => {
            let v = src.to_f32_vec()?;
            let width = v.len() / src.shape()[0].max(1);
            let mut o = vec![0f32; v.len()];
            for (r, &m) in host_map.iter().enumerate() {
                let m = m as usize;
                o[r * width..(r + 1) * width].copy_from_slice(&v[m * width..(m + 1) * width]);
            }
            let out = Tensor::empty(src.shape(), src.dtype(), Device::Cpu)?;
            out.write_f32(&o)?;
            Ok(out)
        }
    }
}

/// Each run `(row, rows)` as element ranges of rows `width` wide.
fn widen(runs: &[Chunks], width: usize) -> Vec<Chunks> {
    runs.iter()
        .map(|c| c.iter().map(|&(o, l)| (o * width, l * width)).collect())
        .collect()
}

/// A forward's state on one rank: its tokens' routing and output, and what its experts received.
pub struct EpForward {
    /// This rank's tokens: output `out`, routing (`idx`, `weights`, `pos`, …), layout `xp`,
    /// `metrics()`; its `hpre` is empty (the activations live with the experts).
    pub routing: MoeForward,
    /// The rows this rank's experts received, expert-major `[R, H]`.
    pub received: Tensor,
    /// Their up projection `[R, 2I]` (gate | up).
    hpre: Tensor,
    /// Each received row's gate weight `[R]` f32 (0 on padding).
    gates: Tensor,
    /// The local experts' segment ends in `received` (int32 `[E/W]`).
    ends: Tensor,
    plan: Plan,
    maps: Maps,
    /// A forward with a backward to come whose backward has not run (it writes the gradient
    /// over `hpre` on CUDA: one backward per forward).
    backward_ready: std::sync::atomic::AtomicBool,
}

impl<'g> ExpertParallel<'g> {
    /// The layer `cfg` with model dim `hidden`, expert dim `inter`, `dtype` on `device`, its
    /// experts spread evenly over `pg`'s ranks (attached to `device`'s kind). A collective: every
    /// rank calls it, and it fails on every rank if their settings differ.
    pub fn new(
        pg: &'g ProcessGroup,
        cfg: &MoeConfig,
        hidden: usize,
        inter: usize,
        dtype: DType,
        device: Device,
    ) -> Result<ExpertParallel<'g>> {
        cfg.validate(1)?;
        let w = pg.world();
        if !cfg.experts.is_multiple_of(w) {
            return Err(Error::bad_arg(
                OP,
                "experts",
                format!("a multiple of the world size {w} (each rank owns E/W experts)"),
                cfg.experts,
            ));
        }
        if hidden == 0 || inter == 0 {
            return Err(Error::bad_arg(
                OP,
                "hidden/inter",
                "≥ 1",
                format!("{hidden}/{inter}"),
            ));
        }
        let kind = match device {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        };
        pg.check_same(
            "the expert-parallel MoE layer",
            &format!("{cfg:?} H{hidden} I{inter} {dtype} {kind}"),
        )?;
        Ok(ExpertParallel {
            pg,
            cfg: cfg.clone(),
            hidden,
            inter,
            dtype,
            device,
            phases: Default::default(),
        })
    }

    /// From now on (`on`), every phase of a call waits for the device and records its wall
    /// time (route, plan, dispatch, experts, …): where a layer's time goes, at the cost of the
    /// waits. `take_phases` returns them.
    pub fn profile_phases(&self, on: bool) {
        *self.phases.borrow_mut() = on.then(|| (std::time::Instant::now(), Vec::new()));
    }

    /// The phases recorded since the last call (milliseconds; empty when not profiling).
    pub fn take_phases(&self) -> Vec<(&'static str, f64)> {
        match &mut *self.phases.borrow_mut() {
            Some((t, v)) => {
                *t = std::time::Instant::now();
                std::mem::take(v)
            }
            None => Vec::new(),
        }
    }

    /// Ends phase `name` when profiling: waits for the device and records the time since the
    /// previous mark.
    fn mark(&self, name: &'static str) -> Result<()> {
        if let Some((t, v)) = &mut *self.phases.borrow_mut() {
            if let Device::Cuda(i) = self.device {
                let d = crate::core::cuda::device(i)?;
                d.synchronize(d.stream(), "moe expert parallel (phase timing)")?;
            }
            let now = std::time::Instant::now();
            v.push((name, (now - *t).as_secs_f64() * 1e3));
            *t = now;
        }
        Ok(())
    }

    /// The experts this rank owns.
    pub fn experts(&self) -> std::ops::Range<usize> {
        let n = self.local();
        self.pg.rank() * n..(self.pg.rank() + 1) * n
    }

    fn local(&self) -> usize {
        self.cfg.experts / self.pg.world()
    }

    /// Checks a call: x `[T, H]`, the whole router `[E, H]`, this rank's `w_up [E/W, H, 2I]` and
    /// `w_down [E/W, I, H]`.
    fn problem(&self, x: &Tensor, w: &MoeWeights) -> Result<Problem> {
        let (h, i, e, el, dt, dev) = (
            self.hidden,
            self.inter,
            self.cfg.experts,
            self.local(),
            self.dtype,
            self.device,
        );
        if x.rank() != 2 || x.shape()[1] != h {
            return Err(Error::bad_arg(
                OP,
                "x",
                format!("a contiguous {dt}[T, {h}] on {dev}"),
                describe(x),
            ));
        }
        let t = x.shape()[0];
        self.cfg.validate(t)?;
        expect(x, "x", &[t, h], dt, dev)?;
        expect(w.router, "router", &[e, h], dt, dev)?;
        expect(
            w.w_up,
            "w_up (this rank's experts)",
            &[el, h, 2 * i],
            dt,
            dev,
        )?;
        expect(
            w.w_down,
            "w_down (this rank's experts)",
            &[el, i, h],
            dt,
            dev,
        )?;
        Ok(Problem {
            tokens: t,
            hidden: h,
            inter: i,
            experts: e,
            top_k: self.cfg.top_k,
            dtype: dt,
            device: dev,
        })
    }

    /// The problem the local experts' stage runs: `rows` received rows over E/W experts.
    fn local_problem(&self, p: &Problem, rows: usize) -> Problem {
        Problem {
            tokens: rows.max(1),
            experts: self.local(),
            top_k: 1,
            ..*p
        }
    }

    /// Exchanges the padded segment sizes and plans the all-to-alls (the host synchronisation).
    fn plan(&self, f: &MoeForward, ctx: Option<&cuda::Ctx>) -> Result<Plan> {
        let (w, el, e) = (self.pg.world(), self.local(), self.cfg.experts);
        let segs = match ctx {
            Some(x) => {
                let s = x.seg_sizes(&f.ends, e)?;
                // The process group's communicator runs on the device's own stream: the sizes
                // (written on the call's stream, maybe a caller's) must be there first.
                x.sync()?;
                s
            }
            None => {
                let ends = f.ends.to_vec::<i32>()?;
                let s: Vec<i32> = (0..e)
                    .map(|x| ends[x] - if x > 0 { ends[x - 1] } else { 0 })
                    .collect();
                Tensor::from_vec(s, &[e])?
            }
        };
        let got = match ctx {
            Some(x) => x.empty(&[w * el], DType::I32)?,
            None => Tensor::from_vec(vec![0i32; w * el], &[w * el])?,
        };
        let per_peer: Vec<Chunks> = (0..w).map(|d| vec![(d * el, el)]).collect();
        self.pg.all_to_all_v(&segs, &per_peer, &got, &per_peer)?;
        let ends = f.ends.to_vec::<i32>()?;
        let got = got.to_vec::<i32>()?;
        let start = |x: usize| if x > 0 { ends[x - 1] as usize } else { 0 };
        let to = (0..w)
            .map(|d| {
                let (a, b) = (start(d * el), ends[(d + 1) * el - 1] as usize);
                vec![(a, b - a)]
            })
            .collect();
        if let Some(&n) = got.iter().find(|&&n| n < 0) {
            return Err(Error::Other(format!(
                "moe expert parallel: rank {} received a segment size of {n}",
                self.pg.rank()
            )));
        }
        // Arrival order: by sending rank, each rank's segments in expert order.
        let mut from: Vec<Chunks> = Vec::with_capacity(w);
        let mut seg_at = vec![0usize; w * el];
        let mut at = 0usize;
        for s in 0..w {
            let first = at;
            for j in 0..el {
                seg_at[s * el + j] = at;
                at += got[s * el + j] as usize;
            }
            from.push(vec![(first, at - first)]);
        }
        if at > i32::MAX as usize {
            return Err(Error::bad_arg(
                OP,
                "x",
                "< 2³¹ rows received by one rank's experts",
                at,
            ));
        }
        // Expert-major order: expert j's segments from rank 0, 1, … .
        let mut local_ends = Vec::with_capacity(el);
        let mut order = Vec::with_capacity(at.max(1));
        for j in 0..el {
            for s in 0..w {
                let a = seg_at[s * el + j];
                order.extend((a..a + got[s * el + j] as usize).map(|r| r as i32));
            }
            local_ends.push(order.len() as i32);
        }
        let mut back = vec![0i32; at.max(1)];
        for (r, &a) in order.iter().enumerate() {
            back[a as usize] = r as i32;
        }
        if order.is_empty() {
            order.push(0);
        }
        Ok(Plan {
            to,
            from,
            ends: local_ends,
            rows: at,
            order,
            back,
        })
    }

    /// A tensor on the layer's device (in `ctx`'s stream order on a GPU).
    fn empty(&self, ctx: Option<&cuda::Ctx>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        match ctx {
            Some(x) => x.empty(shape, dtype),
            None => Tensor::empty(shape, dtype, Device::Cpu),
        }
    }

    /// `rows` `[n, width]` of `src` (runs `send`) into a new `[m, width]` tensor of its dtype
    /// (runs `recv`).
    fn exchange(
        &self,
        ctx: Option<&cuda::Ctx>,
        src: &Tensor,
        (send, recv): (&[Chunks], &[Chunks]),
        m: usize,
        width: usize,
    ) -> Result<Tensor> {
        let dtype = src.dtype();
        let shape: &[usize] = if width == 1 { &[m] } else { &[m, width] };
        // The CPU collectives carry f32: a CPU layer's values travel as f32 (bf16/f16 values
        // are exact in it) and are stored back in the dtype.
        let (src, dt) = match (ctx, dtype) {
            (None, d) if d != DType::F32 && d != DType::I32 => {
                (src.to_dtype(DType::F32)?, DType::F32)
            }
            _ => (src.clone(), dtype),
        };
        let out = self.empty(ctx, shape, dt)?;
        self.pg
            .all_to_all_v(&src, &widen(send, width), &out, &widen(recv, width))?;
        if dt != dtype {
            return out.to_dtype(dtype);
        }
        Ok(out)
    }

    /// Rows of this rank's layout `src` (`width` wide) to the experts' owners, in expert-major
    /// order there (`[plan.rows.max(1), width]`).
    fn dispatch(
        &self,
        ctx: Option<&cuda::Ctx>,
        src: &Tensor,
        (plan, maps): (&Plan, &Maps),
        width: usize,
    ) -> Result<Tensor> {
        let arrived = self.exchange(ctx, src, (&plan.to, &plan.from), plan.rows.max(1), width)?;
        reorder(ctx, &arrived, &maps.order, &plan.order)
    }

    /// The reverse: expert-major rows `src` back into the routing ranks' layouts (`[rows_cap,
    /// width]`; rows not sent back — padding, unused — are left unwritten).
    fn collect(
        &self,
        ctx: Option<&cuda::Ctx>,
        src: &Tensor,
        (plan, maps): (&Plan, &Maps),
        rows_cap: usize,
        width: usize,
    ) -> Result<Tensor> {
        let arrival = reorder(ctx, src, &maps.back, &plan.back)?;
        self.exchange(ctx, &arrival, (&plan.from, &plan.to), rows_cap, width)
    }

    /// The forward on this rank's tokens x `[T, H]` (w: the whole router and this rank's
    /// experts). A collective: every rank calls it with its own tokens (T may differ per rank).
    pub fn forward(&self, x: &Tensor, w: &MoeWeights, opts: &MoeOptions) -> Result<EpForward> {
        let p = self.problem(x, w)?;
        let cfg = &self.cfg;
        let f = MoeForward::alloc_with(&p, opts.stream.as_ref(), false)?;
        let ctx = match p.device {
            Device::Cuda(_) => Some(cuda::Ctx::new(&p, opts)?),
            Device::Cpu => None,
        };
        let ctx = ctx.as_ref();
        // The CPU rungs: `parallel` unless `naive` is asked for.
        let par = opts.variant.as_deref() != Some("naive");
        let routed = match ctx {
            Some(c) => {
                cuda::route(c, &p, x, w, cfg, &f)?;
                None
            }
            None => Some(cpu::route_into(par, &p, x, w.router, cfg, &f)?),
        };
        self.mark("fwd route")?;
        let plan = self.plan(&f, ctx)?;
        let pl = self.local_problem(&p, plan.rows);
        let variant = select(&pl, opts.variant.as_deref())?;
        let rows = plan.rows.max(1);
        let (h, i, dt) = (p.hidden, p.inter, p.dtype);
        // The local ends and both row orders in one host→device copy.
        let (no, nb, el) = (plan.order.len(), plan.back.len(), self.local());
        let mut all = Vec::with_capacity(el + no + nb);
        all.extend_from_slice(&plan.ends);
        all.extend_from_slice(&plan.order);
        all.extend_from_slice(&plan.back);
        let all = Tensor::from_vec(all, &[el + no + nb])?.to_device(p.device)?;
        let ends = all.narrow(0, 0, el)?;
        let maps = Maps {
            order: all.narrow(0, el, no)?,
            back: all.narrow(0, el + no, nb)?,
        };
        self.mark("fwd plan")?;
        let xr = self.dispatch(ctx, &f.xp, (&plan, &maps), h)?;
        let row_w = match ctx {
            Some(c) => c.gather_f32(&f.weights, &f.src)?,
            None => {
                let v = cpu::gather_f32(&f.weights.to_f32_vec()?, &f.src.to_vec::<i32>()?);
                Tensor::from_vec(v, &[p.rows_cap()])?
            }
        };
        let gates = self.dispatch(ctx, &row_w, (&plan, &maps), 1)?;
        drop(row_w);
        self.mark("fwd dispatch")?;
        let hpre = self.empty(ctx, &[rows, 2 * i], dt)?;
        let y = match ctx {
            Some(c) => {
                let s = cuda::Segs {
                    rows,
                    experts: self.local(),
                    ends: &ends,
                    host: Some(&plan.ends),
                };
                cuda::experts_forward(c, variant, &pl, s, (&xr, &hpre), w, cfg, !opts.forward_only)?
            }
            None => {
                let (wu, wd) = (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?);
                let (hp, y) = cpu::experts_forward(
                    variant == "parallel",
                    &pl,
                    &plan.ends,
                    rows,
                    &xr.to_f32_vec()?,
                    &wu,
                    &wd,
                    cfg.act,
                )?;
                hpre.write_f32(&hp)?;
                let yt = Tensor::empty(&[rows, h], dt, Device::Cpu)?;
                yt.write_f32(&y)?;
                yt
            }
        };
        self.mark("fwd experts")?;
        let y = self.collect(ctx, &y, (&plan, &maps), p.rows_cap(), h)?;
        self.mark("fwd return")?;
        match (ctx, &routed) {
            (Some(c), _) => cuda::combine(c, &p, cfg, &f, &y)?,
            (None, Some(r)) => cpu::combine_into(par, &p, cfg, (&f, r), &y.to_f32_vec()?)?,
            (None, None) => unreachable!("the CPU route returns its host values"),
        }
        self.mark("fwd combine")?;
        Ok(EpForward {
            routing: f,
            received: xr,
            hpre,
            gates,
            ends,
            plan,
            maps,
            backward_ready: (!opts.forward_only).into(),
        })
    }

    /// The backward: dout `[T, H]` → dx, d_router (this rank's tokens' share), and this rank's
    /// experts' dw_up `[E/W, H, 2I]` / dw_down `[E/W, I, H]` (every rank's tokens). `loss_grad`:
    /// the incoming gradients of the aux and z-losses (f32, ≥ 2 elements; None: 1 each). A
    /// collective, as the forward.
    pub fn backward(
        &self,
        dout: &Tensor,
        x: &Tensor,
        w: &MoeWeights,
        fwd: &EpForward,
        loss_grad: Option<&Tensor>,
        opts: &MoeOptions,
    ) -> Result<MoeGrads> {
        let p = self.problem(x, w)?;
        if p != fwd.routing.problem {
            return Err(Error::bad_arg(
                OP,
                "fwd",
                format!("the forward of this call ({})", p.label()),
                fwd.routing.problem.label(),
            ));
        }
        let not_ready = || {
            Error::bad_arg(
                OP,
                "fwd",
                "the state of a forward run without forward_only, not yet used by a backward",
                "a forward_only or already back-propagated forward (one backward per forward)",
            )
        };
        if !fwd
            .backward_ready
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(not_ready());
        }
        expect(dout, "dout", &[p.tokens, p.hidden], p.dtype, p.device)?;
        if let Some(l) = loss_grad {
            if l.dtype() != DType::F32 || l.numel() < 2 || l.device() != p.device {
                return Err(Error::bad_arg(
                    OP,
                    "loss_grad",
                    format!("a contiguous f32 tensor of ≥ 2 elements on {}", p.device),
                    describe(l),
                ));
            }
        }
        // Claimed after the checks: a refused call leaves the state usable.
        if !fwd
            .backward_ready
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            return Err(not_ready());
        }
        let (f, plan, maps) = (&fwd.routing, &fwd.plan, &fwd.maps);
        let ctx = match p.device {
            Device::Cuda(_) => Some(cuda::Ctx::new(&p, opts)?),
            Device::Cpu => None,
        };
        let ctx = ctx.as_ref();
        let par = opts.variant.as_deref() != Some("naive");
        let pl = self.local_problem(&p, plan.rows);
        let variant = select(&pl, opts.variant.as_deref())?;
        let (t, h, i, el, dt) = (p.tokens, p.hidden, p.inter, self.local(), p.dtype);
        let rows = plan.rows.max(1);
        let g = MoeGrads {
            dx: self.empty(ctx, &[t, h], dt)?,
            d_router: self.empty(ctx, &[p.experts, h], dt)?,
            dw_up: self.empty(ctx, &[el, h, 2 * i], dt)?,
            dw_down: self.empty(ctx, &[el, i, h], dt)?,
        };
        // dout's rows in the layout, unscaled (zeros on padding), to the experts' owners.
        let dyu = match ctx {
            Some(c) => {
                let d = c.empty(&[p.rows_cap(), h], dt)?;
                cuda::spread_rows(c, &p, dout, f, &d)?;
                d
            }
            None => {
                let ends = f.ends.to_vec::<i32>()?;
                let v = cpu::spread(
                    par,
                    &p,
                    &dout.to_f32_vec()?,
                    &f.src.to_vec::<i32>()?,
                    ends[p.experts - 1] as usize,
                )?;
                Tensor::from_vec(v, &[p.rows_cap(), h])?
            }
        };
        self.mark("bwd spread")?;
        let dyu_r = self.dispatch(ctx, &dyu, (plan, maps), h)?;
        drop(dyu);
        self.mark("bwd dispatch")?;
        let (dxr, dw_r) = match ctx {
            Some(c) => {
                let s = cuda::Segs {
                    rows,
                    experts: el,
                    ends: &fwd.ends,
                    host: Some(&plan.ends),
                };
                // Every received row is its own "pair": src = the row, its gate weight received.
                let src = c.iota(rows)?;
                let dw = c.empty(&[rows], DType::F32)?;
                c.zero(&dw)?;
                let dxr = cuda::experts_backward(
                    c,
                    variant,
                    &pl,
                    s,
                    cuda::ExpertGrads {
                        dyu: dyu_r,
                        xp: &fwd.received,
                        hpre: &fwd.hpre,
                        src: &src,
                        weights: &fwd.gates,
                        dw: &dw,
                        dw_up: &g.dw_up,
                        dw_down: &g.dw_down,
                    },
                    w,
                    &self.cfg,
                )?;
                (dxr, dw)
            }
            None => {
                let (wu, wd) = (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?);
                let eg = cpu::experts_backward(
                    variant == "parallel",
                    &pl,
                    &plan.ends,
                    &fwd.gates.to_f32_vec()?,
                    (
                        &dyu_r.to_f32_vec()?,
                        &fwd.received.to_f32_vec()?,
                        &fwd.hpre.to_f32_vec()?,
                    ),
                    &wu,
                    &wd,
                    self.cfg.act,
                )?;
                g.dw_up.write_f32(&eg.dw_up)?;
                g.dw_down.write_f32(&eg.dw_down)?;
                let dxr = Tensor::empty(&[rows, h], dt, Device::Cpu)?;
                dxr.write_f32(&eg.dxp)?;
                (dxr, Tensor::from_vec(eg.dots, &[rows])?)
            }
        };
        self.mark("bwd experts")?;
        // dX rows and the gates' gradients back to the routing ranks.
        let dxp = self.collect(ctx, &dxr, (plan, maps), p.rows_cap(), h)?;
        let dw_rows = self.collect(ctx, &dw_r, (plan, maps), p.rows_cap(), 1)?;
        self.mark("bwd return")?;
        match ctx {
            Some(c) => {
                let dw = c.gather_f32(&dw_rows, &f.pos)?;
                cuda::router_backward(
                    c,
                    &p,
                    x,
                    w.router,
                    f,
                    &self.cfg,
                    (&dxp, &dw),
                    &g,
                    loss_grad,
                )?;
            }
            None => {
                let dw = cpu::gather_f32(&dw_rows.to_f32_vec()?, &f.pos.to_vec::<i32>()?);
                let cfg = cpu::scaled_losses(&self.cfg, loss_grad)?;
                cpu::router_backward(par, &p, x, w.router, f, &cfg, (&dxp.to_f32_vec()?, &dw), &g)?;
            }
        }
        self.mark("bwd router")?;
        Ok(g)
    }
}

/// Expert parallelism's bookkeeping kernels (kernels/moe.cu, moe_ep_*).
impl cuda::Ctx {
    /// `[E]` i32: each padded expert segment's rows, from the layout's ends.
    pub(crate) fn seg_sizes(&self, ends: &Tensor, e: usize) -> Result<Tensor> {
        let out = self.empty(&[e], DType::I32)?;
        let mut a = KernelArgs::new();
        a.push(ends.device_ptr()?)
            .push(e as i32)
            .push(out.device_ptr()?);
        self.launch("moe_ep_seg_sizes", self.grid(e, 256), 256, 0, &mut a)?;
        Ok(out)
    }

    /// `[idx.numel()]` f32: `vals[idx[i]]`, 0 where `idx[i] < 0` — each layout row's gate
    /// weight from its pair (`idx` = src), each pair's gate gradient from its row (`idx` = pos).
    pub(crate) fn gather_f32(&self, vals: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let n = idx.numel();
        let out = self.empty(&[n], DType::F32)?;
        let mut a = KernelArgs::new();
        a.push(vals.device_ptr()?)
            .push(idx.device_ptr()?)
            .push(n as i64)
            .push(out.device_ptr()?);
        self.launch("moe_ep_gather_f32", self.grid(n, 256), 256, 0, &mut a)?;
        Ok(out)
    }

    /// `dst[r] = src[map[r]]` for the first `map.numel()` rows (contiguous, equal row sizes).
    pub(crate) fn gather_rows(&self, src: &Tensor, map: &Tensor, dst: &Tensor) -> Result<()> {
        let n = map.numel();
        let row_bytes = dst.nbytes() / dst.shape()[0].max(1);
        let (ps, pd) = (src.device_ptr()?, dst.device_ptr()?);
        let vec = row_bytes.is_multiple_of(16) && ps.is_multiple_of(16) && pd.is_multiple_of(16);
        let mut a = KernelArgs::new();
        a.push(ps)
            .push(row_bytes as i64)
            .push(map.device_ptr()?)
            .push(n as i64)
            .push(vec as i32)
            .push(pd);
        self.launch("moe_ep_gather_rows", self.grid(n, 8), 256, 0, &mut a)
    }

    /// `[n]` i32: 0, 1, …, n − 1.
    pub(crate) fn iota(&self, n: usize) -> Result<Tensor> {
        let out = self.empty(&[n], DType::I32)?;
        let mut a = KernelArgs::new();
        a.push(out.device_ptr()?).push(n as i64);
        self.launch("moe_iota", self.grid(n, 256), 256, 0, &mut a)?;
        Ok(out)
    }
}

#[doc(hidden)]
pub mod bench;
#[cfg(test)]
mod tests;
