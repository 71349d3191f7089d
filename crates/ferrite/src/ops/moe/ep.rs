//! Expert parallelism: one layer's experts spread over the ranks of a process group, tokens sent
//! to the rank that owns their expert and the experts' outputs sent back.
//!
//! Rank r of W owns experts `r·E/W .. (r+1)·E/W` (`w_up`/`w_down` hold only those) and routes its
//! own tokens with the whole (replicated) router. A forward, per rank:
//! 1. **route** its tokens exactly as the one-GPU layer does (router, top-k, capacity, the padded
//!    expert-contiguous layout `xp`): expert e's rows are one padded segment, and the experts of
//!    rank d are consecutive, so what goes to d is one run of whole segments — itself a padded
//!    expert-contiguous layout of d's experts;
//! 2. **exchange the segment sizes on the device** (an all-to-all of `E/W` int32 per peer), then
//!    read them, with this rank's own layout ends, in one device→host copy: NCCL's receives need
//!    their sizes on the host, and this is the layer's only host synchronisation;
//! 3. **dispatch** on a second stream and NCCL communicator: one send/recv per peer of its run
//!    (padding rows included, so every block that arrives is a valid layout as it lies) and of each
//!    row's gate weight. Meanwhile the main stream runs the experts over **this rank's own run**,
//!    which never leaves the device: the exchange hides behind that GEMM work;
//! 4. the experts over each block that arrived (the one-GPU layer's expert stage: grouped up
//!    projection, GLU, grouped down projection, the variant chosen for the local experts);
//! 5. **return** the blocks' outputs by the reverse exchange into this rank's layout (its own
//!    run's outputs are already there), and **combine** (`out[t] = Σ_j w[t,j]·y[pos[t,j]]`) and
//!    the losses as the layer does.
//!
//! The backward runs the same way: dout spread into the layout, the peers' runs dispatched while
//! the experts' backward runs on the own run, then on each block that arrived (the gate weights
//! that came with the rows fold in as in the one-GPU kernel, and each row's gate gradient comes
//! from the same GEMM; the blocks' weight gradients add to the own run's), dX rows and gate
//! gradients returned, then the router's backward on the routing rank. Each rank's expert weight
//! gradients cover every rank's tokens routed to its experts; the router's gradient covers this
//! rank's tokens (the router is replicated: sum it over the ranks as for any data-parallel
//! weight).
//!
//! Semantics per rank are those of `moe_forward` on that rank's tokens — capacity is
//! `ceil(T_r·k/E·factor)` of the rank's own T_r, the losses are the rank's — so a rank's output
//! equals the one-GPU layer's on its tokens.

use super::{
    cpu, cuda, expect, select, MoeConfig, MoeForward, MoeGrads, MoeOptions, MoeWeights, Problem, OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::{describe, Tensor};
use crate::dist::{Chunks, ProcessGroup, SideStream};

/// This rank's part of an expert-parallel layer: the run's configuration, checked the same on
/// every rank when made.
pub struct ExpertParallel<'g> {
    pg: &'g ProcessGroup,
    cfg: MoeConfig,
    hidden: usize,
    inter: usize,
    dtype: DType,
    device: Device,
    /// The exchanges' communicator and stream (GPU).
    side: Option<SideStream>,
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

/// Rows of one layout that one expert stage walks: `rows` rows from `start`, the local experts'
/// segment ends relative to `start`.
#[derive(Clone, Debug)]
struct Block {
    start: usize,
    rows: usize,
    ends: Vec<i32>,
}

/// Which rows move where: per peer, the `(first row, rows)` run of this rank's layout that goes to
/// it (`to`) and the run of the arrival buffer its rows land in (`from`; none for this rank);
/// this rank's own run (in its layout) and each arrived block (in the arrival buffer), as the
/// expert stages walk them.
struct Plan {
    to: Vec<Chunks>,
    from: Vec<Chunks>,
    own: Block,
    arrived: Vec<Block>,
    /// Rows of the arrival buffer.
    rows: usize,
}

impl Plan {
    /// Every expert stage: the own run first (in the layout), then the arrived blocks.
    fn stages(&self) -> impl Iterator<Item = (bool, &Block)> {
        std::iter::once((true, &self.own)).chain(self.arrived.iter().map(|b| (false, b)))
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
    /// The rows that arrived from the other ranks for this rank's experts `[R, H]`.
    pub received: Tensor,
    /// The up projection `[own rows + R, 2I]` (gate | up) of the own run, then of the arrivals.
    hpre: Tensor,
    /// Each layout row's gate weight `[rows_cap]` and each arrived row's `[R]` (f32, 0 on
    /// padding).
    row_w: Tensor,
    gates: Tensor,
    /// The local experts' ends of every stage (int32 `[stages, E/W]`).
    ends: Tensor,
    plan: Plan,
    backward_ready: bool,
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
        let side = match device {
            Device::Cuda(_) => Some(pg.side_stream(device)?),
            Device::Cpu => None,
        };
        Ok(ExpertParallel {
            pg,
            cfg: cfg.clone(),
            hidden,
            inter,
            dtype,
            device,
            side,
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

    /// Exchanges the padded segment sizes and plans the exchanges (the host synchronisation).
    fn plan(&self, f: &MoeForward, ctx: Option<&cuda::Ctx>) -> Result<Plan> {
        let (w, el, e, me) = (
            self.pg.world(),
            self.local(),
            self.cfg.experts,
            self.pg.rank(),
        );
        let segs = match ctx {
            Some(x) => {
                let s = x.seg_sizes(&f.ends, e)?;
                // The process group's communicator runs on the device's stream: the sizes
                // must be there before it reads them.
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
        if let Some(&n) = got.iter().find(|&&n| n < 0) {
            return Err(Error::Other(format!(
                "moe expert parallel: rank {me} received a segment size of {n}"
            )));
        }
        let start = |x: usize| if x > 0 { ends[x - 1] as usize } else { 0 };
        let run = |d: usize| {
            (
                start(d * el),
                ends[(d + 1) * el - 1] as usize - start(d * el),
            )
        };
        let to = (0..w)
            .map(|d| if d == me { vec![] } else { vec![run(d)] })
            .collect();
        let (s0, n0) = run(me);
        let own = Block {
            start: s0,
            rows: n0,
            ends: (me * el..(me + 1) * el)
                .map(|x| ends[x] - s0 as i32)
                .collect(),
        };
        // Arrivals: by sending rank, each block its sender's segments for this rank's experts.
        let (mut from, mut arrived) = (Vec::with_capacity(w), Vec::new());
        let mut at = 0usize;
        for s in 0..w {
            if s == me {
                from.push(vec![]);
                continue;
            }
            let mut run = 0usize;
            let mut bends = Vec::with_capacity(el);
            for j in 0..el {
                run += got[s * el + j] as usize;
                bends.push(run as i32);
            }
            from.push(vec![(at, run)]);
            arrived.push(Block {
                start: at,
                rows: run,
                ends: bends,
            });
            at += run;
        }
        if at > i32::MAX as usize {
            return Err(Error::bad_arg(
                OP,
                "x",
                "< 2³¹ rows received by one rank's experts",
                at,
            ));
        }
        Ok(Plan {
            to,
            from,
            own,
            arrived,
            rows: at,
        })
    }

    /// A tensor on the layer's device (in `ctx`'s stream order on a GPU).
    fn empty(&self, ctx: Option<&cuda::Ctx>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        match ctx {
            Some(x) => x.empty(shape, dtype),
            None => Tensor::empty(shape, dtype, Device::Cpu),
        }
    }

    /// Rows `width` wide of `src` (runs `send`, per peer) into `dst` (runs `recv`): on the side
    /// stream after the main stream's work so far (GPU; the caller joins the main stream back
    /// before reading `dst`), through the rendezvous on the CPU.
    fn exchange(
        &self,
        ctx: Option<&cuda::Ctx>,
        (src, send): (&Tensor, &[Chunks]),
        (dst, recv): (&Tensor, &[Chunks]),
        width: usize,
    ) -> Result<()> {
        let (send, recv) = (widen(send, width), widen(recv, width));
        match (ctx, &self.side) {
            (Some(c), Some(side)) => {
                side.stream()
                    .join(&c.stream)
                    .map_err(|e| Error::cuda("moe expert parallel: side stream waits", e))?;
                side.all_to_all_v(src, &send, dst, &recv)
            }
            _ if matches!(src.dtype(), DType::F32 | DType::I32) => {
                self.pg.all_to_all_v(src, &send, dst, &recv)
            }
            _ => {
                // The CPU collectives carry f32: bf16/f16 values travel exactly as f32.
                let (s32, d32) = (src.to_dtype(DType::F32)?, dst.to_dtype(DType::F32)?);
                self.pg.all_to_all_v(&s32, &send, &d32, &recv)?;
                dst.write_f32(&d32.to_f32_vec()?)
            }
        }
    }

    /// The main stream waits for the side stream's exchanges (GPU).
    fn join_side(&self, ctx: Option<&cuda::Ctx>) -> Result<()> {
        if let (Some(c), Some(side)) = (ctx, &self.side) {
            c.stream
                .join(side.stream())
                .map_err(|e| Error::cuda("moe expert parallel: waiting for the exchange", e))?;
        }
        Ok(())
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
        match ctx {
            Some(c) => cuda::route(c, &p, x, w, cfg, &f)?,
            None => cpu::route_into(par, &p, x, w.router, cfg, &f)?,
        }
        self.mark("fwd route")?;
        let plan = self.plan(&f, ctx)?;
        let pl = self.local_problem(&p, plan.rows.max(plan.own.rows));
        let variant = select(&pl, opts.variant.as_deref())?;
        let (h, i, dt, el) = (p.hidden, p.inter, p.dtype, self.local());
        let stages: Vec<(bool, Block)> = plan.stages().map(|(o, b)| (o, b.clone())).collect();
        let mut all_ends = Vec::with_capacity(stages.len() * el);
        for (_, b) in &stages {
            all_ends.extend_from_slice(&b.ends);
        }
        let ends = Tensor::from_vec(all_ends, &[stages.len(), el])?.to_device(p.device)?;
        let row_w = match ctx {
            Some(c) => c.row_weights(&f, p.rows_cap())?,
            None => {
                let v = cpu::row_scales(&f.src.to_vec::<i32>()?, &f.weights.to_f32_vec()?);
                Tensor::from_vec(v, &[p.rows_cap()])?
            }
        };
        let r = plan.rows.max(1);
        let received = self.empty(ctx, &[r, h], dt)?;
        let gates = self.empty(ctx, &[r], DType::F32)?;
        let hpre = self.empty(ctx, &[plan.own.rows + r, 2 * i], dt)?;
        let y = self.empty(ctx, &[p.rows_cap(), h], dt)?;
        let y_arr = self.empty(ctx, &[r, h], dt)?;
        self.mark("fwd plan")?;
        // The peers' runs travel while the experts run over the own run.
        self.exchange(ctx, (&f.xp, &plan.to), (&received, &plan.from), h)?;
        self.exchange(ctx, (&row_w, &plan.to), (&gates, &plan.from), 1)?;
        let (wu, wd) = match ctx {
            Some(_) => (Vec::new(), Vec::new()),
            None => (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?),
        };
        for (n, (own, b)) in stages.iter().enumerate() {
            if !own && n == 1 {
                self.mark("fwd experts (own rows)")?;
                self.join_side(ctx)?;
                self.mark("fwd dispatch (rest)")?;
            }
            if b.rows == 0 {
                continue;
            }
            let (src, out) = if *own {
                (&f.xp, &y)
            } else {
                (&received, &y_arr)
            };
            let xs = src.narrow(0, b.start, b.rows)?;
            let ys = out.narrow(0, b.start, b.rows)?;
            let hp = hpre.narrow(0, if *own { 0 } else { plan.own.rows + b.start }, b.rows)?;
            match ctx {
                Some(c) => {
                    let e = ends.narrow(0, n, 1)?.reshape(&[el])?;
                    let s = cuda::Segs {
                        rows: b.rows,
                        experts: el,
                        ends: &e,
                        host: Some(&b.ends),
                    };
                    let fo = !opts.forward_only;
                    cuda::experts_forward(c, variant, &pl, s, (&xs, &hp, &ys), w, cfg, fo)?;
                }
                None => {
                    let (hv, yv) = cpu::experts_forward(
                        variant == "parallel",
                        &pl,
                        &b.ends,
                        b.rows,
                        &xs.to_f32_vec()?,
                        &wu,
                        &wd,
                        cfg.act,
                    )?;
                    hp.write_f32(&hv)?;
                    ys.write_f32(&yv)?;
                }
            }
        }
        self.mark("fwd experts (arrived rows)")?;
        self.exchange(ctx, (&y_arr, &plan.from), (&y, &plan.to), h)?;
        self.join_side(ctx)?;
        self.mark("fwd return")?;
        match ctx {
            Some(c) => cuda::combine(c, &p, cfg, &f, &y)?,
            None => cpu::combine_into(par, &p, cfg, &f, &y.to_f32_vec()?)?,
        }
        self.mark("fwd combine")?;
        Ok(EpForward {
            routing: f,
            received,
            hpre,
            row_w,
            gates,
            ends,
            plan,
            backward_ready: !opts.forward_only,
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
        if !fwd.backward_ready {
            return Err(Error::bad_arg(
                OP,
                "fwd",
                "the state of a forward run without forward_only",
                "a forward_only forward",
            ));
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
        let (f, plan) = (&fwd.routing, &fwd.plan);
        let ctx = match p.device {
            Device::Cuda(_) => Some(cuda::Ctx::new(&p, opts)?),
            Device::Cpu => None,
        };
        let ctx = ctx.as_ref();
        let par = opts.variant.as_deref() != Some("naive");
        let pl = self.local_problem(&p, plan.rows.max(plan.own.rows));
        let variant = select(&pl, opts.variant.as_deref())?;
        let (t, h, i, el, dt) = (p.tokens, p.hidden, p.inter, self.local(), p.dtype);
        let r = plan.rows.max(1);
        let g = MoeGrads {
            dx: self.empty(ctx, &[t, h], dt)?,
            d_router: self.empty(ctx, &[p.experts, h], dt)?,
            dw_up: self.empty(ctx, &[el, h, 2 * i], dt)?,
            dw_down: self.empty(ctx, &[el, i, h], dt)?,
        };
        // dout's rows in the layout, unscaled (zeros on padding).
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
                Tensor::from_vec(v, &[p.rows_cap(), h])?.to_dtype(dt)?
            }
        };
        let dyu_arr = self.empty(ctx, &[r, h], dt)?;
        let dxp = self.empty(ctx, &[p.rows_cap(), h], dt)?;
        let dxr = self.empty(ctx, &[r, h], dt)?;
        let dw_rows = self.empty(ctx, &[p.rows_cap()], DType::F32)?;
        let dw_arr = self.empty(ctx, &[r], DType::F32)?;
        let iota = match ctx {
            Some(c) => c.iota(r.max(plan.own.rows))?,
            None => Tensor::from_vec(
                (0..r.max(plan.own.rows) as i32).collect::<Vec<_>>(),
                &[r.max(plan.own.rows)],
            )?,
        };
        self.mark("bwd spread")?;
        self.exchange(ctx, (&dyu, &plan.to), (&dyu_arr, &plan.from), h)?;
        let (wu, wd) = match ctx {
            Some(_) => (Vec::new(), Vec::new()),
            None => (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?),
        };
        // Host sums of the CPU stages' weight gradients.
        let (mut up_sum, mut down_sum): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let mut written = false;
        for (n, (own, b)) in plan.stages().enumerate() {
            if !own && n == 1 {
                self.mark("bwd experts (own rows)")?;
                self.join_side(ctx)?;
                self.mark("bwd dispatch (rest)")?;
            }
            if b.rows == 0 {
                continue;
            }
            // Own run: rows of the layout, its gate weights and gate-gradient rows 0-based in
            // the run; arrived blocks: rows of the arrival buffers, indexed by arrival row.
            let (dy, xs, dxo) = if own {
                (&dyu, &f.xp, &dxp)
            } else {
                (&dyu_arr, &fwd.received, &dxr)
            };
            let dy = dy.narrow(0, b.start, b.rows)?;
            let xs = xs.narrow(0, b.start, b.rows)?;
            let dxo = dxo.narrow(0, b.start, b.rows)?;
            let hp = fwd
                .hpre
                .narrow(0, if own { 0 } else { plan.own.rows + b.start }, b.rows)?;
            let (src, wts, dwo) = if own {
                (
                    iota.narrow(0, 0, b.rows)?,
                    fwd.row_w.narrow(0, b.start, b.rows)?,
                    dw_rows.narrow(0, b.start, b.rows)?,
                )
            } else {
                (
                    iota.narrow(0, b.start, b.rows)?,
                    fwd.gates.clone(),
                    dw_arr.clone(),
                )
            };
            match ctx {
                Some(c) => {
                    let e = fwd.ends.narrow(0, n, 1)?.reshape(&[el])?;
                    let s = cuda::Segs {
                        rows: b.rows,
                        experts: el,
                        ends: &e,
                        host: Some(&b.ends),
                    };
                    cuda::experts_backward(
                        c,
                        variant,
                        &pl,
                        s,
                        cuda::ExpertGrads {
                            dyu: dy,
                            xp: &xs,
                            hpre: &hp,
                            src: &src,
                            weights: &wts,
                            dxp: &dxo,
                            dw: &dwo,
                            dw_up: &g.dw_up,
                            dw_down: &g.dw_down,
                            accumulate: written,
                        },
                        w,
                        &self.cfg,
                    )?;
                }
                None => {
                    let eg = cpu::experts_backward(
                        variant == "parallel",
                        &pl,
                        &b.ends,
                        // the block's own rows of the gate weights
                        &if own {
                            wts.to_f32_vec()?
                        } else {
                            wts.narrow(0, b.start, b.rows)?.to_f32_vec()?
                        },
                        (&dy.to_f32_vec()?, &xs.to_f32_vec()?, &hp.to_f32_vec()?),
                        &wu,
                        &wd,
                        self.cfg.act,
                    )?;
                    dxo.write_f32(&eg.dxp)?;
                    if own {
                        dwo.write_f32(&eg.dots)?;
                    } else {
                        // Arrival rows: this block's part of the arrival buffer.
                        dw_arr.narrow(0, b.start, b.rows)?.write_f32(&eg.dots)?;
                    }
                    if written {
                        up_sum.iter_mut().zip(&eg.dw_up).for_each(|(a, v)| *a += v);
                        down_sum
                            .iter_mut()
                            .zip(&eg.dw_down)
                            .for_each(|(a, v)| *a += v);
                    } else {
                        (up_sum, down_sum) = (eg.dw_up, eg.dw_down);
                    }
                }
            }
            written = true;
        }
        match ctx {
            Some(c) if !written => {
                // No rows reached this rank's experts: their gradients are zero.
                c.zero(&g.dw_up)?;
                c.zero(&g.dw_down)?;
            }
            Some(_) => {}
            None if !written => {
                g.dw_up.write_f32(&vec![0.0; g.dw_up.numel()])?;
                g.dw_down.write_f32(&vec![0.0; g.dw_down.numel()])?;
            }
            None => {
                let r = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x = cpu::round(dt, *x));
                r(&mut up_sum);
                r(&mut down_sum);
                g.dw_up.write_f32(&up_sum)?;
                g.dw_down.write_f32(&down_sum)?;
            }
        }
        self.mark("bwd experts (arrived rows)")?;
        // dX rows and the gates' gradients back to the routing ranks.
        self.exchange(ctx, (&dxr, &plan.from), (&dxp, &plan.to), h)?;
        self.exchange(ctx, (&dw_arr, &plan.from), (&dw_rows, &plan.to), 1)?;
        self.join_side(ctx)?;
        self.mark("bwd return")?;
        match ctx {
            Some(c) => {
                let dw = c.pair_values(&dw_rows, &f.pos)?;
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
                let rv = dw_rows.to_f32_vec()?;
                let dw: Vec<f32> = f
                    .pos
                    .to_vec::<i32>()?
                    .iter()
                    .map(|&r| if r >= 0 { rv[r as usize] } else { 0.0 })
                    .collect();
                let cfg = cpu::scaled_losses(&self.cfg, loss_grad)?;
                cpu::router_backward(par, &p, x, w.router, f, &cfg, (&dxp.to_f32_vec()?, &dw), &g)?;
            }
        }
        self.mark("bwd router")?;
        Ok(g)
    }
}

#[doc(hidden)]
pub mod bench;
#[cfg(test)]
mod tests;
