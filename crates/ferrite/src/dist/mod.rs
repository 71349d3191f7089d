//! # dist — several processes, one model: the process group the trainer's data parallelism runs on
//!
//! One process per GPU (or per CPU worker), started by `ferrite train --nproc N` or by any
//! launcher that sets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`). Two layers, as in torch.distributed:
//!
//! - a **rendezvous** over TCP (`store`): rank 0 listens, the others connect; it checks at start
//!   that every rank runs the same configuration, hands out NCCL's unique id, and carries small
//!   host values (a step's loss) — and, on the CPU, the gradients themselves (a sum in rank order,
//!   so a CPU run is deterministic and needs nothing installed);
//! - **NCCL** (`nccl`) on the GPU: all-reduce, reduce-scatter and all-gather queued on ferrite's
//!   stream, in place on ferrite tensors.
//!
//! Failures name the rank: a rank that does not join, exits, or stays silent past
//! `FERRITE_DIST_TIMEOUT` seconds (default 600) is an error on every other rank, not a hang.

mod nccl;
mod store;

use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use std::time::Duration;

/// Where this process stands among the ranks of a run (torchrun's variables).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// Processes in the run.
    pub world: usize,
    /// This process's rank on its machine (its GPU's ordinal).
    pub local_rank: usize,
    /// Rank 0's host.
    pub addr: String,
    /// Rank 0's port.
    pub port: u16,
}

fn env_num(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => {
            v.trim().parse::<usize>().map(Some).map_err(|_| {
                Error::bad_arg("dist", name, "a non-negative integer", format!("{v:?}"))
            })
        }
        Err(_) => Ok(None),
    }
}

impl DistEnv {
    /// The run's ranks from the environment; `None` when `WORLD_SIZE` is unset or 1 (one process).
    pub fn from_env() -> Result<Option<DistEnv>> {
        let world = match env_num("WORLD_SIZE")? {
            None | Some(1) => return Ok(None),
            Some(0) => return Err(Error::bad_arg("dist", "WORLD_SIZE", "≥ 1", 0)),
            Some(w) => w,
        };
        let rank = env_num("RANK")?.ok_or_else(|| {
            Error::bad_arg(
                "dist",
                "RANK",
                format!("set (0..{world}) when WORLD_SIZE is {world}"),
                "unset",
            )
        })?;
        let local_rank = env_num("LOCAL_RANK")?.unwrap_or(rank);
        let port = env_num("MASTER_PORT")?
            .ok_or_else(|| Error::bad_arg("dist", "MASTER_PORT", "rank 0's port", "unset"))?;
        let port = u16::try_from(port)
            .map_err(|_| Error::bad_arg("dist", "MASTER_PORT", "a port ≤ 65535", port))?;
        let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let e = DistEnv {
            rank,
            world,
            local_rank,
            addr,
            port,
        };
        e.validate()?;
        Ok(Some(e))
    }

    fn validate(&self) -> Result<()> {
        if self.world > i32::MAX as usize {
            return Err(Error::bad_arg("dist", "WORLD_SIZE", "< 2³¹", self.world));
        }
        if self.rank >= self.world {
            return Err(Error::bad_arg(
                "dist",
                "RANK",
                format!("0..{} (WORLD_SIZE {})", self.world, self.world),
                self.rank,
            ));
        }
        Ok(())
    }
}

/// The wait before a silent rank is an error (`FERRITE_DIST_TIMEOUT`, seconds, default 600).
pub fn timeout() -> Result<Duration> {
    match std::env::var("FERRITE_DIST_TIMEOUT") {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
            _ => Err(Error::bad_arg(
                "dist",
                "FERRITE_DIST_TIMEOUT",
                "seconds, a number > 0",
                format!("{v:?}"),
            )),
        },
        Err(_) => Ok(Duration::from_secs(600)),
    }
}

/// This process's membership in a run of several: collectives over every rank.
pub struct ProcessGroup {
    env: DistEnv,
    store: store::Store,
    nccl: Option<nccl::NcclComm>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup(rank {} of {}, {})",
            self.env.rank,
            self.env.world,
            if self.nccl.is_some() { "NCCL" } else { "host" }
        )
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn sum_f32(all: &[Vec<u8>]) -> std::result::Result<Vec<u8>, String> {
    let n = all[0].len();
    if let Some((r, p)) = all.iter().enumerate().find(|(_, p)| p.len() != n) {
        return Err(format!(
            "ranks disagree on the all-reduce's size: rank 0 sent {} values, rank {r} {}",
            n / 4,
            p.len() / 4
        ));
    }
    let mut acc: Vec<f32> = all[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for p in &all[1..] {
        for (a, c) in acc.iter_mut().zip(p.chunks_exact(4)) {
            *a += f32::from_le_bytes(c.try_into().unwrap());
        }
    }
    Ok(f32_bytes(&acc))
}

impl ProcessGroup {
    /// Joins the run described by `env` (every rank calls this; it returns once all have joined).
    pub fn new(env: DistEnv) -> Result<ProcessGroup> {
        Self::with_timeout(env, timeout()?)
    }

    /// As [`ProcessGroup::new`], waiting `timeout` for a silent rank instead of
    /// `FERRITE_DIST_TIMEOUT`.
    pub fn with_timeout(env: DistEnv, timeout: Duration) -> Result<ProcessGroup> {
        env.validate()?;
        let store = store::Store::connect(env.rank, env.world, &env.addr, env.port, timeout)?;
        Ok(ProcessGroup {
            env,
            store,
            nccl: None,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }
    /// Ranks in the run.
    pub fn world(&self) -> usize {
        self.env.world
    }
    /// This process's rank on its machine.
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }
    /// Whether tensors on the GPU travel by NCCL (after [`ProcessGroup::attach`] to a GPU).
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Every rank must pass the same `value` (a configuration, serialised); otherwise every
    /// rank fails with the first rank that differs and both values.
    pub fn check_same(&self, what: &str, value: &str) -> Result<()> {
        self.store
            .exchange(&format!("check {what}"), value.as_bytes(), |all| match all
                .iter()
                .position(|v| v != &all[0])
            {
                None => Ok(vec![]),
                Some(r) => Err(format!(
                    "ranks disagree on {what}: rank 0 has {}, rank {r} has {}",
                    String::from_utf8_lossy(&all[0]),
                    String::from_utf8_lossy(&all[r])
                )),
            })
            .map(|_| ())
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self, what: &str) -> Result<()> {
        self.store
            .exchange(&format!("barrier {what}"), &[], |_| Ok(vec![]))
            .map(|_| ())
    }

    /// `v ← Σ_ranks v` for a few host values (summed in rank order: the same on every rank).
    pub fn all_reduce_host(&self, v: &mut [f32]) -> Result<()> {
        let out = self
            .store
            .exchange("all_reduce_host", &f32_bytes(v), sum_f32)?;
        for (x, c) in v.iter_mut().zip(out.chunks_exact(4)) {
            *x = f32::from_le_bytes(c.try_into().unwrap());
        }
        Ok(())
    }

    /// Makes collectives on tensors of `device` run there: on a GPU an NCCL communicator over
    /// every rank on ferrite's stream (every rank must attach, each to its own device). On the
    /// CPU, tensor collectives travel through the rendezvous.
    pub fn attach(&mut self, device: Device) -> Result<()> {
        let local = self.env.local_rank;
        let kind = match device {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        };
        self.check_same("the device kind", kind)?;
        let Device::Cuda(i) = device else {
            return Ok(());
        };
        let dev = crate::core::cuda::device(i)?;
        let ok = nccl::available();
        let all_ok = {
            let mut v = [if ok { 0.0 } else { 1.0 }];
            self.all_reduce_host(&mut v)?;
            v[0] == 0.0
        };
        if !all_ok {
            return Err(Error::Other(format!(
                "dist: rank {} (cuda:{i}, local rank {local}): NCCL is not loadable on every rank \
                 (this one: {}). ferrite loads libnccl.so at run time: put a folder holding \
                 libnccl.so (NCCL's packages ship libnccl.so.2; a link named libnccl.so to it will \
                 do) on LD_LIBRARY_PATH",
                self.env.rank,
                if ok { "found" } else { "not found" }
            )));
        }
        let id = self.nccl_id("nccl id")?;
        let stream = dev.stream().clone();
        self.nccl = Some(nccl::NcclComm::new(
            dev,
            stream,
            self.env.rank,
            self.env.world,
            id,
        )?);
        Ok(())
    }

    /// Rank 0's fresh NCCL unique id, on every rank.
    fn nccl_id(&self, what: &str) -> Result<[u8; 128]> {
        let mine = if self.env.rank == 0 {
            nccl::unique_id()?.to_vec()
        } else {
            vec![]
        };
        let id = self.store.exchange(what, &mine, |all| Ok(all[0].clone()))?;
        id.try_into()
            .map_err(|_| Error::Other("dist: NCCL's unique id is not 128 bytes".into()))
    }

    /// A second communicator over every rank, on a stream of its own on `device` (a GPU this
    /// group is attached to): gradients all-reduced there while the backward goes on (see
    /// [`GradientStream`]). A collective: every rank calls it.
    pub fn gradient_stream(&self, device: Device) -> Result<GradientStream> {
        let Device::Cuda(i) = device else {
            return Err(Error::bad_arg(
                "dist::gradient_stream",
                "device",
                "a GPU",
                device,
            ));
        };
        if self.nccl.is_none() {
            return Err(Error::Other(
                "dist::gradient_stream: attach the process group to the GPU first".into(),
            ));
        }
        let dev = crate::core::cuda::device(i)?;
        dev.bind()?;
        let side = dev
            .context()
            .new_stream()
            .map_err(|e| Error::cuda("cuStreamCreate (gradient stream)", e))?;
        let id = self.nccl_id("nccl id (gradient stream)")?;
        let comm = nccl::NcclComm::new(dev, side.clone(), self.env.rank, self.env.world, id)?;
        Ok(GradientStream { comm, side })
    }

    /// CPU collectives take contiguous f32 tensors (the rendezvous carries them).
    fn check_host(t: &Tensor, op: &str) -> Result<()> {
        if t.dtype() != DType::F32 || !t.is_contiguous() {
            return Err(Error::bad_arg(
                op,
                "tensor",
                "a contiguous f32 tensor (CPU collectives)",
                format!(
                    "{} {}",
                    t.dtype(),
                    if t.is_contiguous() {
                        "contiguous"
                    } else {
                        "strided"
                    }
                ),
            ));
        }
        Ok(())
    }

    /// A CPU f32 tensor's values as bytes.
    fn host_bytes(t: &Tensor, op: &str) -> Result<Vec<u8>> {
        Self::check_host(t, op)?;
        t.with_cpu::<f32, _>(|s| f32_bytes(&s[..t.numel()]))
    }

    /// Writes f32 values given as bytes into a CPU tensor.
    fn store_bytes(t: &Tensor, bytes: &[u8]) -> Result<()> {
        t.with_cpu_mut::<f32, _>(|s| {
            for (x, c) in s.iter_mut().zip(bytes.chunks_exact(4)) {
                *x = f32::from_le_bytes(c.try_into().unwrap());
            }
        })
    }

    fn not_attached(op: &str) -> Error {
        Error::Other(format!(
            "{op}: a GPU tensor, but the process group is not attached to a GPU"
        ))
    }

    /// `t ← Σ_ranks t`, in place: NCCL on the GPU (queued on ferrite's stream), the rendezvous on
    /// the CPU (f32, summed in rank order).
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        match (t.device(), &self.nccl) {
            (Device::Cuda(_), Some(c)) => c.all_reduce_sum(t),
            (Device::Cuda(_), None) => Err(Self::not_attached("dist::all_reduce")),
            (Device::Cpu, _) => {
                let bytes = Self::host_bytes(t, "dist::all_reduce")?;
                let out = self.store.exchange("all_reduce", &bytes, sum_f32)?;
                Self::store_bytes(t, &out)
            }
        }
    }

    /// `out ← this rank's slice of Σ_ranks input`, where `input` holds `world` slices of
    /// `out.numel()` elements in rank order.
    pub fn reduce_scatter_sum(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        let w = self.env.world;
        if input.numel() != w * out.numel() {
            return Err(Error::bad_arg(
                "dist::reduce_scatter",
                "input",
                format!("world {w} × out's {} elements", out.numel()),
                input.numel(),
            ));
        }
        match (input.device(), &self.nccl) {
            (Device::Cuda(_), Some(c)) => c.reduce_scatter_sum(input, out),
            (Device::Cuda(_), None) => Err(Self::not_attached("dist::reduce_scatter")),
            (Device::Cpu, _) => {
                Self::check_host(out, "dist::reduce_scatter")?;
                let bytes = Self::host_bytes(input, "dist::reduce_scatter")?;
                let sum = self.store.exchange("reduce_scatter", &bytes, sum_f32)?;
                let n = out.numel() * 4;
                Self::store_bytes(out, &sum[self.env.rank * n..(self.env.rank + 1) * n])
            }
        }
    }

    /// `out ← every rank's `input` in rank order` (`out` holds `world · input.numel()`).
    pub fn all_gather(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        let w = self.env.world;
        if out.numel() != w * input.numel() || out.dtype() != input.dtype() {
            return Err(Error::bad_arg(
                "dist::all_gather",
                "out",
                format!("{} × {} {} elements", w, input.numel(), input.dtype()),
                format!("{} {}", out.numel(), out.dtype()),
            ));
        }
        match (input.device(), &self.nccl) {
            (Device::Cuda(_), Some(c)) => c.all_gather(input, out),
            (Device::Cuda(_), None) => Err(Self::not_attached("dist::all_gather")),
            (Device::Cpu, _) => {
                Self::check_host(out, "dist::all_gather")?;
                let bytes = Self::host_bytes(input, "dist::all_gather")?;
                let all = self.store.exchange("all_gather", &bytes, |all| {
                    if let Some(r) = all.iter().position(|p| p.len() != all[0].len()) {
                        return Err(format!(
                            "ranks disagree on the all-gather's size: rank 0 sent {} values, rank {r} {}",
                            all[0].len() / 4,
                            all[r].len() / 4
                        ));
                    }
                    Ok(all.concat())
                })?;
                Self::store_bytes(out, &all)
            }
        }
    }
}

impl ProcessGroup {
    /// All-to-all with ranges of any sizes: `sends[d]` lists the `(offset, len)` element ranges of
    /// `send` that go to rank d, `recvs[s]` the ranges of `recv` that the data from rank s lands
    /// in, matched in order (a range sent and the one it lands in have the same length — the
    /// caller agrees on them beforehand, as an expert-parallel layer does by exchanging its
    /// counts first). NCCL's grouped send/recv on the GPU (queued on ferrite's stream); on the
    /// CPU (f32 or i32) through the rendezvous, which checks the lengths.
    pub fn all_to_all_v(
        &self,
        send: &Tensor,
        sends: &[Chunks],
        recv: &Tensor,
        recvs: &[Chunks],
    ) -> Result<()> {
        let op = "dist::all_to_all";
        let w = self.env.world;
        if send.dtype() != recv.dtype() || send.device() != recv.device() {
            return Err(Error::bad_arg(
                op,
                "recv",
                format!("{} on {} (send's)", send.dtype(), send.device()),
                format!("{} on {}", recv.dtype(), recv.device()),
            ));
        }
        for (name, t, lists) in [("sends", send, sends), ("recvs", recv, recvs)] {
            if lists.len() != w {
                return Err(Error::bad_arg(
                    op,
                    name,
                    format!("one list of ranges per rank ({w})"),
                    lists.len(),
                ));
            }
            if !t.is_contiguous() {
                return Err(Error::bad_arg(
                    op,
                    name,
                    "a contiguous tensor",
                    "a strided view",
                ));
            }
            let n = t.numel();
            if let Some(&(o, l)) = lists
                .iter()
                .flatten()
                .find(|(o, l)| o.checked_add(*l).is_none_or(|e| e > n))
            {
                return Err(Error::bad_arg(
                    op,
                    name,
                    format!("ranges inside the tensor's {n} elements"),
                    format!("{o}..{}", o.saturating_add(l)),
                ));
            }
        }
        match (send.device(), &self.nccl) {
            (Device::Cuda(_), Some(c)) => c.all_to_all_v(send, sends, recv, recvs),
            (Device::Cuda(_), None) => Err(Self::not_attached(op)),
            (Device::Cpu, _) => self.all_to_all_v_host(send, sends, recv, recvs),
        }
    }

    fn all_to_all_v_host(
        &self,
        send: &Tensor,
        sends: &[Chunks],
        recv: &Tensor,
        recvs: &[Chunks],
    ) -> Result<()> {
        let op = "dist::all_to_all";
        if !matches!(send.dtype(), DType::F32 | DType::I32) {
            return Err(Error::bad_arg(
                op,
                "send",
                "f32 or i32 (CPU collectives)",
                send.dtype(),
            ));
        }
        let bytes = send.to_bytes()?;
        // This rank's payload: per destination, its byte count and its ranges' bytes in order.
        let mut mine = Vec::new();
        for list in sends {
            let n: usize = list.iter().map(|c| c.1 * 4).sum();
            mine.extend_from_slice(&(n as u64).to_le_bytes());
            for &(o, l) in list {
                mine.extend_from_slice(&bytes[o * 4..(o + l) * 4]);
            }
        }
        let all = self.store.exchange("all_to_all", &mine, |all| {
            let mut out = Vec::new();
            for p in all {
                out.extend_from_slice(&(p.len() as u64).to_le_bytes());
                out.extend_from_slice(p);
            }
            Ok(out)
        })?;
        let me = self.env.rank;
        // Ranges not received keep their values.
        let mut got = recv.to_bytes()?;
        let mut at = 0usize;
        let word =
            |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
        for (src, list) in recvs.iter().enumerate() {
            let len = word(&all, at);
            let payload = &all[at + 8..at + 8 + len];
            at += 8 + len;
            // Skip to the part for this rank.
            let mut q = 0usize;
            for _ in 0..me {
                q += 8 + word(payload, q);
            }
            let n = word(payload, q);
            let part = &payload[q + 8..q + 8 + n];
            let want: usize = list.iter().map(|c| c.1 * 4).sum();
            if n != want {
                return Err(Error::Other(format!(
                    "{op}: rank {src} sends {} elements to rank {me}, which expects {}",
                    n / 4,
                    want / 4
                )));
            }
            let mut r = 0usize;
            for &(o, l) in list {
                got[o * 4..(o + l) * 4].copy_from_slice(&part[r..r + l * 4]);
                r += l * 4;
            }
        }
        let words = got.chunks_exact(4).map(|c| <[u8; 4]>::try_from(c).unwrap());
        match recv.dtype() {
            DType::F32 => recv.with_cpu_mut::<f32, _>(|d| {
                d.iter_mut()
                    .zip(words)
                    .for_each(|(x, b)| *x = f32::from_le_bytes(b))
            }),
            _ => recv.with_cpu_mut::<i32, _>(|d| {
                d.iter_mut()
                    .zip(words)
                    .for_each(|(x, b)| *x = i32::from_le_bytes(b))
            }),
        }
    }
}

/// Element ranges `(offset, len)` of a tensor, in the order they travel (one list per peer of an
/// all-to-all).
pub type Chunks = Vec<(usize, usize)>;

/// Gradient buckets all-reduced on a stream of their own while the backward continues on the
/// main stream (data parallelism's overlap): each bucket waits for the main stream's work queued
/// so far, and the main stream waits for every bucket before it reads the gradients. Stream
/// order only (events), so it can be captured in a CUDA graph with the backward.
pub struct GradientStream {
    comm: nccl::NcclComm,
    side: crate::core::cuda::Stream,
}

impl std::fmt::Debug for GradientStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradientStream")
    }
}

impl GradientStream {
    /// `t ← Σ_ranks t` on the gradient stream, after the work queued on `main` so far.
    pub fn all_reduce_after(&self, t: &Tensor, main: &crate::core::cuda::Stream) -> Result<()> {
        self.side
            .join(main)
            .map_err(|e| Error::cuda("gradient stream: waiting for the backward", e))?;
        self.comm.all_reduce_sum(t)
    }

    /// `main` waits for every all-reduce queued so far.
    pub fn join_into(&self, main: &crate::core::cuda::Stream) -> Result<()> {
        main.join(&self.side)
            .map_err(|e| Error::cuda("waiting for the gradient stream", e))
    }
}

/// A step that never ends is a hang, not a wait: NCCL has no timeout of its own, so a rank whose
/// peer died or hangs before its part of a collective waits forever inside the GPU's queue.
/// The watchdog's thread checks the step that is in progress; past `timeout` it calls `fire`
/// with a message naming this rank, the step and how long it has run (the trainer's `fire`
/// prints it and ends the process, as torch's NCCL watchdog does; with `--nproc` the launcher
/// then stops the other ranks).
pub struct Watchdog {
    state: std::sync::Arc<WatchState>,
    t0: std::time::Instant,
}

#[derive(Default)]
struct WatchState {
    /// The step in progress + 1 (0: none).
    step: std::sync::atomic::AtomicU64,
    /// When it began, ms after the watchdog started.
    since_ms: std::sync::atomic::AtomicU64,
    stop: std::sync::atomic::AtomicBool,
}

impl Watchdog {
    /// Starts the watchdog of `rank`.
    pub fn start(rank: usize, timeout: Duration, fire: Box<dyn Fn(String) + Send>) -> Watchdog {
        use std::sync::atomic::Ordering::Relaxed;
        let state = std::sync::Arc::new(WatchState::default());
        let t0 = std::time::Instant::now();
        let st = state.clone();
        let tick = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let limit = timeout.as_millis() as u64;
        std::thread::spawn(move || loop {
            std::thread::sleep(tick);
            if st.stop.load(Relaxed) {
                return;
            }
            let step = st.step.load(Relaxed);
            let ran = (t0.elapsed().as_millis() as u64).saturating_sub(st.since_ms.load(Relaxed));
            if step != 0 && ran > limit && st.step.load(Relaxed) == step {
                fire(format!(
                    "dist: rank {rank}: step {} has not finished after {:.0} s — a rank died or \
                     hangs, and this one waits for it inside NCCL; FERRITE_DIST_TIMEOUT sets the wait",
                    step - 1,
                    ran as f64 / 1e3
                ));
                return;
            }
        });
        Watchdog { state, t0 }
    }

    /// Step `step` begins.
    pub fn begin(&self, step: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.state
            .since_ms
            .store(self.t0.elapsed().as_millis() as u64, Relaxed);
        self.state.step.store(step as u64 + 1, Relaxed);
    }

    /// The step in progress ended.
    pub fn end(&self) {
        self.state
            .step
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state
            .stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
pub(crate) mod tests;
