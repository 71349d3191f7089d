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

/// One part of the pipeline: this rank's experts `j0..j1`, the per-peer runs of the routing
/// rank's layout that go to the peer (`to`) and of the arrival buffer they land in (`from`),
/// the part's rows `start..start + rows` (the same range in arrival and in expert-major order),
/// and its experts' segment ends relative to `start`.
struct Part {
    j0: usize,
    j1: usize,
    to: Vec<Chunks>,
    from: Vec<Chunks>,
    start: usize,
    rows: usize,
    ends: Vec<i32>,
}

/// Which rows move where: the parts in order; the arrival buffer's rows; `order[r]`: the
/// arrival row of expert-major row r, `back` its inverse.
struct Plan {
    parts: Vec<Part>,
    rows: usize,
    order: Vec<i32>,
    back: Vec<i32>,
}

/// A plan's row orders and ends on the layer's device (int32).
struct Maps {
    order: Tensor,
    back: Tensor,
    /// `[E/W]`: each part's experts' ends, relative to the part's start.
    ends: Tensor,
}

/// `dst[r] = src[map[r]]` over `dst`'s rows (`host_map`: `map`'s values).
fn reorder(
    ctx: Option<&cuda::Ctx>,
    src: &Tensor,
    (map, host_map): (&Tensor, &[i32]),
    dst: &Tensor,
) -> Result<()> {
    match ctx {
        Some(c) => c.gather_rows(src, map, dst),
        None => {
            let v = src.to_f32_vec()?;
            let width = v.len() / src.shape()[0].max(1);
            let mut o = vec![0f32; host_map.len() * width];
            for (r, &m) in host_map.iter().enumerate() {
                let m = m as usize;
                o[r * width..(r + 1) * width].copy_from_slice(&v[m * width..(m + 1) * width]);
            }
            dst.write_f32(&o)
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
    plan: Plan,
    maps: Maps,
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
        if let Some(&n) = got.iter().find(|&&n| n < 0) {
            return Err(Error::Other(format!(
                "moe expert parallel: rank {} received a segment size of {n}",
                self.pg.rank()
            )));
        }
        let start = |x: usize| if x > 0 { ends[x - 1] as usize } else { 0 };
        // Two parts (the first half of the local experts, then the rest) when there are two
        // experts to split: the second part's rows travel while the first part's experts run.
        let bounds: Vec<(usize, usize)> = if el >= 2 {
            vec![(0, el / 2), (el / 2, el)]
        } else {
            vec![(0, el)]
        };
        let (mut parts, mut order) = (Vec::new(), Vec::new());
        let mut at = 0usize;
        for (j0, j1) in bounds {
            let to = (0..w)
                .map(|d| {
                    let (a, b) = (start(d * el + j0), ends[d * el + j1 - 1] as usize);
                    vec![(a, b - a)]
                })
                .collect();
            // Arrival: by sending rank, each rank's segments of these experts in expert order.
            let first = at;
            let mut seg_at = vec![0usize; w * el];
            let mut from = Vec::with_capacity(w);
            for s in 0..w {
                let run = at;
                for j in j0..j1 {
                    seg_at[s * el + j] = at;
                    at += got[s * el + j] as usize;
                }
                from.push(vec![(run, at - run)]);
            }
            // Expert-major: expert j's segments from rank 0, 1, … .
            let mut part_ends = Vec::with_capacity(j1 - j0);
            for j in j0..j1 {
                for s in 0..w {
                    let a = seg_at[s * el + j];
                    order.extend((a..a + got[s * el + j] as usize).map(|r| r as i32));
                }
                part_ends.push((order.len() - first) as i32);
            }
            parts.push(Part {
                j0,
                j1,
                to,
                from,
                start: first,
                rows: at - first,
                ends: part_ends,
            });
        }
        if at > i32::MAX as usize {
            return Err(Error::bad_arg(
                OP,
                "x",
                "< 2³¹ rows received by one rank's experts",
                at,
            ));
        }
        let mut back = vec![0i32; at];
        for (r, &a) in order.iter().enumerate() {
            back[a as usize] = r as i32;
        }
        Ok(Plan {
            parts,
            rows: at,
            order,
            back,
        })
    }

    /// The plan's orders and ends on the layer's device, in one host→device copy.
    fn maps(&self, plan: &Plan, device: Device) -> Result<Maps> {
        let (n, el) = (plan.order.len(), self.local());
        let mut all = Vec::with_capacity(2 * n + el);
        all.extend_from_slice(&plan.order);
        all.extend_from_slice(&plan.back);
        for p in &plan.parts {
            all.extend_from_slice(&p.ends);
        }
        let all = Tensor::from_vec(all, &[2 * n + el])?.to_device(device)?;
        Ok(Maps {
            order: all.narrow(0, 0, n)?,
            back: all.narrow(0, n, n)?,
            ends: all.narrow(0, 2 * n, el)?,
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
    /// stream after the main stream's work so far (GPU; `join_side` before reading `dst`),
    /// through the rendezvous on the CPU.
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

    /// The main stream waits for the exchanges queued on the side stream so far (GPU).
    fn join_side(&self, ctx: Option<&cuda::Ctx>) -> Result<()> {
        if let (Some(c), Some(side)) = (ctx, &self.side) {
            c.stream
                .join(side.stream())
                .map_err(|e| Error::cuda("moe expert parallel: waiting for the exchange", e))?;
        }
        Ok(())
    }

    /// The part's rows `[start, start + rows)` of a `[R, …]` buffer.
    fn rows_of(t: &Tensor, p: &Part) -> Result<Tensor> {
        t.narrow(0, p.start, p.rows)
    }

    /// The pipeline over the parts: part k's rows arrive (the next part's travel meanwhile), go
    /// to expert order, run `stage`, go back to arrival order, and return while the next part
    /// runs. `arrive`: (this rank's layout rows, the arrival buffer, width); `leave`: (the stage's
    /// expert-major output, its arrival-order buffer, this rank's layout buffer, width) — each a
    /// list, exchanged together.
    #[allow(clippy::type_complexity)]
    fn pipeline(
        &self,
        ctx: Option<&cuda::Ctx>,
        (plan, maps): (&Plan, &Maps),
        arrive: &[(&Tensor, &Tensor, &Tensor, usize)],
        leave: &[(&Tensor, &Tensor, &Tensor, usize)],
        mut stage: impl FnMut(usize, &Part) -> Result<()>,
        names: [&'static str; 2],
    ) -> Result<()> {
        let n = plan.parts.len();
        for &(src, arr, _, wd) in arrive {
            self.exchange(
                ctx,
                (src, &plan.parts[0].to),
                (arr, &plan.parts[0].from),
                wd,
            )?;
        }
        self.join_side(ctx)?;
        self.mark(names[0])?;
        for (k, part) in plan.parts.iter().enumerate() {
            if k + 1 < n {
                let next = &plan.parts[k + 1];
                for &(src, arr, _, wd) in arrive {
                    self.exchange(ctx, (src, &next.to), (arr, &next.from), wd)?;
                }
            }
            if part.rows > 0 {
                let ord = Self::rows_of(&maps.order, part)?;
                let hord = &plan.order[part.start..part.start + part.rows];
                for &(_, arr, em, _) in arrive {
                    reorder(ctx, arr, (&ord, hord), &Self::rows_of(em, part)?)?;
                }
                stage(k, part)?;
                let bk = Self::rows_of(&maps.back, part)?;
                let hbk = &plan.back[part.start..part.start + part.rows];
                for &(em, arr, _, _) in leave {
                    reorder(ctx, em, (&bk, hbk), &Self::rows_of(arr, part)?)?;
                }
            }
            // The next part has arrived; this part's results go back while it runs.
            self.join_side(ctx)?;
            for &(_, arr, dst, wd) in leave {
                self.exchange(ctx, (arr, &part.from), (dst, &part.to), wd)?;
            }
        }
        self.join_side(ctx)?;
        self.mark(names[1])
    }

    /// This rank's experts `j0..j1` of `w` (views), and the problem their stage runs.
    fn part_weights<'w>(w: &MoeWeights<'w>, part: &Part) -> Result<(Tensor, Tensor)> {
        let n = part.j1 - part.j0;
        Ok((
            w.w_up.narrow(0, part.j0, n)?,
            w.w_down.narrow(0, part.j0, n)?,
        ))
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
        let maps = self.maps(&plan, p.device)?;
        let pl = self.local_problem(&p, plan.rows);
        let variant = select(&pl, opts.variant.as_deref())?;
        let r = plan.rows.max(1);
        let (h, i, dt) = (p.hidden, p.inter, p.dtype);
        let row_w = match ctx {
            Some(c) => c.row_weights(&f, p.rows_cap())?,
            None => {
                let v = cpu::row_scales(&f.src.to_vec::<i32>()?, &f.weights.to_f32_vec()?);
                Tensor::from_vec(v, &[p.rows_cap()])?
            }
        };
        let (x_arr, received) = (self.empty(ctx, &[r, h], dt)?, self.empty(ctx, &[r, h], dt)?);
        let (g_arr, gates) = (
            self.empty(ctx, &[r], DType::F32)?,
            self.empty(ctx, &[r], DType::F32)?,
        );
        let hpre = self.empty(ctx, &[r, 2 * i], dt)?;
        let (y_em, y_arr) = (self.empty(ctx, &[r, h], dt)?, self.empty(ctx, &[r, h], dt)?);
        let y = self.empty(ctx, &[p.rows_cap(), h], dt)?;
        let host_w = match ctx {
            Some(_) => None,
            None => Some((w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?)),
        };
        self.mark("fwd plan")?;
        let stage = |_: usize, part: &Part| -> Result<()> {
            if part.rows == 0 {
                return Ok(());
            }
            let n = part.j1 - part.j0;
            let pk = Problem { experts: n, ..pl };
            let (xs, hp, ys) = (
                Self::rows_of(&received, part)?,
                Self::rows_of(&hpre, part)?,
                Self::rows_of(&y_em, part)?,
            );
            match ctx {
                Some(c) => {
                    let (wu, wd) = Self::part_weights(w, part)?;
                    let wk = MoeWeights {
                        router: w.router,
                        w_up: &wu,
                        w_down: &wd,
                    };
                    let ends = maps.ends.narrow(0, part.j0, n)?;
                    let s = cuda::Segs {
                        rows: part.rows,
                        experts: n,
                        ends: &ends,
                        host: Some(&part.ends),
                    };
                    let keep = !opts.forward_only;
                    cuda::experts_forward(c, variant, &pk, s, (&xs, &hp, &ys), &wk, cfg, keep)
                }
                None => {
                    let (wu, wd) = host_w.as_ref().expect("host weights on the CPU");
                    let (su, sd) = (h * 2 * i, i * h);
                    let (hv, yv) = cpu::experts_forward(
                        variant == "parallel",
                        &pk,
                        &part.ends,
                        part.rows,
                        &xs.to_f32_vec()?,
                        &wu[part.j0 * su..part.j1 * su],
                        &wd[part.j0 * sd..part.j1 * sd],
                        cfg.act,
                    )?;
                    hp.write_f32(&hv)?;
                    ys.write_f32(&yv)
                }
            }
        };
        self.pipeline(
            ctx,
            (&plan, &maps),
            &[(&f.xp, &x_arr, &received, h), (&row_w, &g_arr, &gates, 1)],
            &[(&y_em, &y_arr, &y, h)],
            stage,
            ["fwd dispatch (first part)", "fwd experts and exchanges"],
        )?;
        match ctx {
            Some(c) => cuda::combine(c, &p, cfg, &f, &y)?,
            None => cpu::combine_into(par, &p, cfg, &f, &y.to_f32_vec()?)?,
        }
        self.mark("fwd combine")?;
        Ok(EpForward {
            routing: f,
            received,
            hpre,
            gates,
            plan,
            maps,
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
        let (dy_arr, dy_em) = (self.empty(ctx, &[r, h], dt)?, self.empty(ctx, &[r, h], dt)?);
        let (dx_em, dx_arr) = (self.empty(ctx, &[r, h], dt)?, self.empty(ctx, &[r, h], dt)?);
        let (dw_em, dw_arr) = (
            self.empty(ctx, &[r], DType::F32)?,
            self.empty(ctx, &[r], DType::F32)?,
        );
        let dxp = self.empty(ctx, &[p.rows_cap(), h], dt)?;
        let dw_rows = self.empty(ctx, &[p.rows_cap()], DType::F32)?;
        let most = plan.parts.iter().map(|q| q.rows).max().unwrap_or(0).max(1);
        let iota = match ctx {
            Some(c) => Some(c.iota(most)?),
            None => None,
        };
        let host_w = match ctx {
            Some(_) => None,
            None => Some((w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?)),
        };
        self.mark("bwd spread")?;
        let stage = |_: usize, part: &Part| -> Result<()> {
            let n = part.j1 - part.j0;
            let (du, dd) = (
                g.dw_up.narrow(0, part.j0, n)?,
                g.dw_down.narrow(0, part.j0, n)?,
            );
            if part.rows == 0 {
                // No rows reached these experts: their gradients are zero.
                return match ctx {
                    Some(c) => c.zero(&du).and_then(|_| c.zero(&dd)),
                    None => du
                        .write_f32(&vec![0.0; du.numel()])
                        .and_then(|_| dd.write_f32(&vec![0.0; dd.numel()])),
                };
            }
            let pk = Problem { experts: n, ..pl };
            let rows = |t: &Tensor| Self::rows_of(t, part);
            match ctx {
                Some(c) => {
                    let (wu, wd) = Self::part_weights(w, part)?;
                    let wk = MoeWeights {
                        router: w.router,
                        w_up: &wu,
                        w_down: &wd,
                    };
                    let ends = maps.ends.narrow(0, part.j0, n)?;
                    let s = cuda::Segs {
                        rows: part.rows,
                        experts: n,
                        ends: &ends,
                        host: Some(&part.ends),
                    };
                    // Every row is its own "pair": src = the row, its gate weight received.
                    let src = iota
                        .as_ref()
                        .expect("iota on the GPU")
                        .narrow(0, 0, part.rows)?;
                    let (hp, xs, dxo) = (rows(&fwd.hpre)?, rows(&fwd.received)?, rows(&dx_em)?);
                    let (wts, dwo) = (rows(&fwd.gates)?, rows(&dw_em)?);
                    let grads = cuda::ExpertGrads {
                        dyu: rows(&dy_em)?,
                        xp: &xs,
                        hpre: &hp,
                        src: &src,
                        weights: &wts,
                        dxp: &dxo,
                        dw: &dwo,
                        dw_up: &du,
                        dw_down: &dd,
                    };
                    cuda::experts_backward(c, variant, &pk, s, grads, &wk, &self.cfg)
                }
                None => {
                    let (wu, wd) = host_w.as_ref().expect("host weights on the CPU");
                    let (su, sd) = (h * 2 * i, i * h);
                    let eg = cpu::experts_backward(
                        variant == "parallel",
                        &pk,
                        &part.ends,
                        &rows(&fwd.gates)?.to_f32_vec()?,
                        (
                            &rows(&dy_em)?.to_f32_vec()?,
                            &rows(&fwd.received)?.to_f32_vec()?,
                            &rows(&fwd.hpre)?.to_f32_vec()?,
                        ),
                        &wu[part.j0 * su..part.j1 * su],
                        &wd[part.j0 * sd..part.j1 * sd],
                        self.cfg.act,
                    )?;
                    rows(&dx_em)?.write_f32(&eg.dxp)?;
                    rows(&dw_em)?.write_f32(&eg.dots)?;
                    du.write_f32(&eg.dw_up)?;
                    dd.write_f32(&eg.dw_down)
                }
            }
        };
        self.pipeline(
            ctx,
            (plan, maps),
            &[(&dyu, &dy_arr, &dy_em, h)],
            &[(&dx_em, &dx_arr, &dxp, h), (&dw_em, &dw_arr, &dw_rows, 1)],
            stage,
            ["bwd dispatch (first part)", "bwd experts and exchanges"],
        )?;
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

    /// `[rows]` f32: each layout row's gate weight (0 on padding and unused rows).
    pub(crate) fn row_weights(&self, f: &MoeForward, rows: usize) -> Result<Tensor> {
        let out = self.empty(&[rows], DType::F32)?;
        let mut a = KernelArgs::new();
        a.push(f.src.device_ptr()?)
            .push(f.weights.device_ptr()?)
            .push(rows as i64)
            .push(out.device_ptr()?);
        self.launch("moe_ep_row_weights", self.grid(rows, 256), 256, 0, &mut a)?;
        Ok(out)
    }

    /// `[pairs]` f32: `rowv[pos[p]]` for each kept pair, 0 for a dropped one.
    pub(crate) fn pair_values(&self, rowv: &Tensor, pos: &Tensor) -> Result<Tensor> {
        let n = pos.numel();
        let out = self.empty(&[n], DType::F32)?;
        let mut a = KernelArgs::new();
        a.push(rowv.device_ptr()?)
            .push(pos.device_ptr()?)
            .push(n as i64)
            .push(out.device_ptr()?);
        self.launch("moe_ep_pair_values", self.grid(n, 256), 256, 0, &mut a)?;
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
