//! `ferrite data bench`: the raw read ceiling of the files' device, the loader's throughput to the
//! host and to the GPU, and a simulated training loop's consumer wait — all in one run.
//!
//! The disk's rate drifts between runs (±15–30 % on a virtual disk), so a loader run is never
//! compared with a ceiling measured long before it, or with another read size and depth: a sweep
//! of (read size × reads in flight) picks the loader's configuration (unless the user fixed it),
//! then the ceiling at that very configuration is measured right before and right after every
//! loader run, and each run's ratio is its rate over the mean of its two neighbours. The
//! reported ratio is the median over the runs.

use super::format::{ShardFormat, ShardWriter, DEFAULT_CHUNK_BYTES};
use super::io::{self, AlignedBuf, EngineKind, Files, IoConfig, Req, ALIGN};
use super::loader::{Dataset, Loader, LoaderConfig, LoaderStats};
use super::order::mix64;
use super::pack::GPT2_VOCAB;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use std::path::Path;
use std::time::{Duration, Instant};

/// One raw read pass.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CeilingPoint {
    pub request_bytes: usize,
    pub queue_depth: u32,
    pub engine: String,
    /// Where the pass started (byte offset into the shards, concatenated).
    pub start: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// CPU cores busy per GB/s (process CPU time: the read itself, mostly the kernel's).
    pub cores_per_gbps: f64,
}

/// One configuration of the sweep, measured `gbps.len()` times (on different parts of the data).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepPoint {
    pub request_bytes: usize,
    pub queue_depth: u32,
    pub gbps: Vec<f64>,
    pub mean_gbps: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LoaderRun {
    pub device: String,
    pub batches: u64,
    pub seconds: f64,
    /// From building the loader to its first batch (counted in `seconds`).
    pub first_batch_ms: f64,
    /// Unique payload bytes delivered per second (T tokens per row: the file's rate).
    pub gbps: f64,
    /// Bytes read from the files per second (with alignment/chunk widening).
    pub read_gbps: f64,
    /// CPU time over wall time (all threads of the process).
    pub cpu_cores: f64,
    pub cores_per_gbps: f64,
    pub io: String,
    pub fallback: Option<String>,
    /// The raw ceiling at the loader's read size and depth, measured right before and right
    /// after this run, and their mean.
    pub ceiling_before_gbps: f64,
    pub ceiling_after_gbps: f64,
    pub ceiling_gbps: f64,
    /// gbps / ceiling_gbps (payload), and read_gbps / ceiling_gbps (bytes read).
    pub ratio: f64,
    pub read_ratio: f64,
    pub stats: LoaderStats,
}

/// The loader runs of one device, summarised (medians over the rounds).
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoaderSummary {
    pub device: String,
    pub runs: usize,
    pub gbps: f64,
    /// Median of the same-configuration ceilings around the runs.
    pub ceiling_gbps: f64,
    /// Median of the per-run ratios (each against its own neighbouring ceilings): the headline.
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Median loader rate over the sweep's best single sample (the old, pessimistic measure:
    /// one lucky pass at another configuration and time).
    pub ratio_vs_sweep_max: f64,
    pub cores_per_gbps: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SimRun {
    pub device: String,
    /// Who waits: the host (blocked in `next_batch`, plus a stream synchronisation for a GPU
    /// batch) or the GPU stream (idle between compute kernels).
    pub consumer: String,
    pub steps: u64,
    pub compute_ms_per_batch: f64,
    /// The loader's time per batch (median rate of its runs): compute = factor × this.
    pub read_ms_per_batch: f64,
    /// The raw device's time per batch at the same-configuration ceiling (median).
    pub raw_read_ms_per_batch: f64,
    pub loop_seconds: f64,
    pub wait_seconds: f64,
    /// Wait over the loop, the first batch (startup) excluded.
    pub wait_fraction: f64,
    pub wait_p50_ms: f64,
    pub wait_p99_ms: f64,
    pub wait_max_ms: f64,
    /// Steps that waited more than 1 ms.
    pub waits_over_1ms: u64,
    /// Milliseconds waited in each second of the loop (transients at the start, or hiccups
    /// spread over the run).
    pub wait_ms_by_second: Vec<f64>,
    /// Time to the first batch (not counted in the wait fraction).
    pub startup_ms: f64,
    /// Payload the loader delivered per second of loop (the consumer's pace when it never
    /// waits).
    pub consumed_gbps: f64,
    /// The same-configuration ceiling measured right after the loop: whether the disk itself
    /// was slow around it.
    pub ceiling_after_gbps: f64,
    pub stats: LoaderStats,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub dataset: String,
    pub dataset_bytes: u64,
    pub batch: usize,
    pub seq: usize,
    /// A first pass over the data, not counted (settles the device after the data was written).
    pub warmup: Option<CeilingPoint>,
    pub sweep: Vec<SweepPoint>,
    /// The best single sample of the sweep (what was reported as "the ceiling" before).
    pub sweep_max_gbps: f64,
    /// The loader's read size and reads in flight, and where they come from.
    pub request_bytes: usize,
    pub queue_depth: u32,
    pub config_from: String,
    /// Ceiling passes at the loader's configuration, in the order run (around the loader runs).
    pub paired_ceiling: Vec<CeilingPoint>,
    /// What the raw read alone costs (median over the paired passes), to set against the
    /// loader's cores per GB/s.
    pub raw_cores_per_gbps: f64,
    pub runs: Vec<LoaderRun>,
    pub host: Option<LoaderSummary>,
    pub gpu: Option<LoaderSummary>,
    pub sim: Vec<SimRun>,
}

#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub batch: usize,
    pub seq: usize,
    pub io: IoConfig,
    /// The user fixed the loader's read size / queue depth (else the sweep's best is used).
    pub fixed_request: bool,
    pub fixed_depth: bool,
    /// Request sizes × queue depths tried by the sweep.
    pub ceiling_requests: Vec<usize>,
    pub ceiling_depths: Vec<u32>,
    /// Bytes per sweep sample (0: the whole data set).
    pub sweep_bytes: u64,
    /// Passes over the sweep (alternating direction); each point's mean decides.
    pub sweep_repeats: usize,
    /// Loader runs per device, each between two same-configuration ceiling passes.
    pub rounds: usize,
    /// Stop each loader run and paired ceiling pass after this many bytes (0: the whole data
    /// set once).
    pub max_bytes: u64,
    /// Simulated compute per batch = this × the loader's measured time per batch.
    pub compute_factor: f64,
    pub gpu: Option<usize>,
    /// The simulated loop runs at least this many steps and at least `sim_seconds`.
    pub sim_steps: u64,
    pub sim_seconds: f64,
    /// The simulated compute sleeps instead of spinning (frees the core on small machines; less
    /// precise).
    pub sim_sleep: bool,
    /// Verified windows (64 MiB each) queued ahead of the assembler.
    pub read_ahead: usize,
    /// Batches assembled ahead of the consumer.
    pub prefetch: usize,
    /// Verify chunk checksums while loading.
    pub verify: bool,
    /// Read the data once before measuring.
    pub warmup: bool,
    /// Shuffle (false: shard order, sequential reads; to tell the access pattern's cost apart).
    pub shuffle: bool,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF covers every thread of the process.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The median of a non-empty list (mean of the middle two for even lengths); 0 when empty.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Reads the files with `qd` reads of `req` bytes in flight (O_DIRECT through the same engine
/// setup the loader uses): from byte `start` of the shards taken end to end (rounded down to
/// 4096 in its shard), front to back and wrapping around, `max_bytes` (0: the whole data once).
pub fn raw_read(
    ds: &Dataset,
    req: usize,
    qd: u32,
    engine: EngineKind,
    start: u64,
    max_bytes: u64,
) -> Result<CeilingPoint> {
    let paths: Vec<_> = ds.shards.iter().map(|s| s.path.clone()).collect();
    let sizes: Vec<_> = ds.shards.iter().map(|s| s.file_bytes).collect();
    let total_size: u64 = sizes.iter().sum();
    let mut files = Files::open(&paths, &sizes)?;
    let cfg = IoConfig {
        engine,
        queue_depth: qd,
        threads: qd as usize,
        direct: true,
        request_bytes: req,
    };
    let want = if max_bytes == 0 {
        total_size
    } else {
        max_bytes.min(total_size)
    };
    // The read plan: (file, offset, length), from the shard holding `start`, wrapping.
    let mut todo = Vec::new();
    let (mut f, mut off) = (0usize, start % total_size.max(1));
    while off >= sizes[f] {
        off -= sizes[f];
        f += 1;
    }
    off = io::align_down(off);
    let mut total = 0u64;
    while total < want {
        if off >= sizes[f] {
            (f, off) = ((f + 1) % sizes.len(), 0);
            continue;
        }
        let len = ((sizes[f] - off) as usize)
            .min(req)
            .min((want - total).next_multiple_of(ALIGN as u64) as usize);
        todo.push((f, off, len));
        total += len as u64;
        off += len as u64;
    }
    todo.reverse();
    let mut bufs: Vec<AlignedBuf> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut setup = io::setup(&cfg, &mut files);
    let engine = &mut setup.engine;
    let slots = engine.capacity();
    for i in 0..slots {
        bufs.push(AlignedBuf::new(req));
        free.push(i);
    }
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let mut done = Vec::new();
    let mut got = 0u64;
    let mut meta = vec![(0usize, 0u64, 0usize); slots];
    loop {
        while let (Some(&(f, off, len)), Some(&slot)) = (todo.last(), free.last()) {
            todo.pop();
            free.pop();
            meta[slot] = (f, off, len);
            let r = Req {
                token: slot as u64,
                fd: files.fd(f),
                off,
                len: io::align_up(len as u64) as usize,
                dst: bufs[slot].as_mut_ptr(),
            };
            // SAFETY: the slot's buffer (req bytes, aligned, ≥ align_up(len)) is not touched
            // until its completion returns it to `free`; bufs outlive the engine's drain below.
            unsafe { engine.submit(r)? };
        }
        if engine.outstanding() == 0 {
            break;
        }
        done.clear();
        engine.wait(&mut done)?;
        for d in &done {
            let (f, off, len) = meta[d.token as usize];
            let n = io::check_done(&paths[f], off, d.res, len)?;
            got += n.min(len) as u64;
            free.push(d.token as usize);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let gbps = got as f64 / secs / 1e9;
    Ok(CeilingPoint {
        request_bytes: req,
        queue_depth: qd,
        engine: setup.description.clone(),
        start,
        bytes: got,
        seconds: secs,
        gbps,
        cores_per_gbps: (cpu_seconds() - c0) / secs / gbps.max(1e-12),
    })
}

fn loader_config(cfg: &BenchConfig, device: Device, epochs: Option<u64>) -> LoaderConfig {
    LoaderConfig {
        batch: cfg.batch,
        seq: cfg.seq,
        epochs,
        device,
        io: cfg.io.clone(),
        read_ahead: cfg.read_ahead,
        prefetch: cfg.prefetch,
        verify: cfg.verify,
        shuffle: cfg.shuffle,
        ..LoaderConfig::default()
    }
}

/// Runs the loader (one rank, shuffled) until `max_bytes` of payload are delivered or the epoch
/// ends; the consumer touches nothing but the batch handle. The clock starts before the loader
/// is built, so the time to fill its pipeline counts.
pub fn loader_run(ds: &Dataset, cfg: &BenchConfig, device: Device) -> Result<LoaderRun> {
    let es = ds.dtype().size_in_bytes() as u64;
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let mut l = Loader::new(ds, loader_config(cfg, device, Some(1)), None)?;
    let mut payload = 0u64;
    let mut first = None;
    while let Some(b) = l.next_batch()? {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1e3);
        payload += b.valid_rows as u64 * cfg.seq as u64 * es;
        if device.is_cuda() {
            // Wait for the copy to land, as a consumer's kernel would.
            let dev = b.tokens.cuda_device()?;
            dev.synchronize(dev.stream(), "loader bench")?;
        }
        if cfg.max_bytes > 0 && payload >= cfg.max_bytes {
            break;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    let st = l.stats();
    let gbps = payload as f64 / secs / 1e9;
    Ok(LoaderRun {
        device: device.to_string(),
        batches: st.batches,
        seconds: secs,
        first_batch_ms: first.unwrap_or(0.0),
        gbps,
        read_gbps: st.bytes_read as f64 / secs / 1e9,
        cpu_cores: cpu / secs,
        cores_per_gbps: cpu / secs / gbps.max(1e-12),
        io: st.io.clone(),
        fallback: st.fallback.clone(),
        ceiling_before_gbps: 0.0,
        ceiling_after_gbps: 0.0,
        ceiling_gbps: 0.0,
        ratio: 0.0,
        read_ratio: 0.0,
        stats: st,
    })
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// A training loop that "computes" `compute_ms` per batch (a spin on the host, after the batch's
/// copy has landed for GPU batches) for at least `sim_steps` steps and `sim_seconds`, and
/// measures how long each step waited for its batch.
pub fn sim_run(ds: &Dataset, cfg: &BenchConfig, device: Device, compute_ms: f64) -> Result<SimRun> {
    let steps = cfg
        .sim_steps
        .max((cfg.sim_seconds * 1e3 / compute_ms.max(1e-6)).ceil() as u64);
    let es = ds.dtype().size_in_bytes() as u64;
    let mut l = Loader::new(ds, loader_config(cfg, device, None), None)?;
    let d = Duration::from_secs_f64(compute_ms / 1e3);
    let mut waits = Vec::with_capacity(steps as usize);
    let mut startup = 0.0;
    let mut loop_start = Instant::now();
    let mut payload = 0u64;
    let mut by_second: Vec<f64> = Vec::new();
    for step in 0..=steps {
        let w0 = Instant::now();
        let b = l
            .next_batch()?
            .ok_or_else(|| Error::Other("the loader ended during the simulated loop".into()))?;
        if device.is_cuda() {
            let dev = b.tokens.cuda_device()?;
            dev.synchronize(dev.stream(), "sim loop")?;
        }
        let waited = w0.elapsed().as_secs_f64();
        if step == 0 {
            startup = waited;
            loop_start = Instant::now();
        } else {
            waits.push(waited);
            payload += b.valid_rows as u64 * cfg.seq as u64 * es;
            let sec = w0.duration_since(loop_start).as_secs() as usize;
            if by_second.len() <= sec {
                by_second.resize(sec + 1, 0.0);
            }
            by_second[sec] += waited * 1e3;
        }
        if cfg.sim_sleep {
            std::thread::sleep(d);
        } else {
            spin(d);
        }
        drop(b);
    }
    let loop_s = loop_start.elapsed().as_secs_f64();
    let stats = l.stats();
    drop(l);
    Ok(sim_report(
        SimTimeline {
            device: device.to_string(),
            consumer: if device.is_cuda() {
                "host, synchronising on each batch's copy".into()
            } else {
                "host".into()
            },
            steps,
            compute_ms,
            loop_s,
            waits,
            by_second,
            startup_s: startup,
            payload,
        },
        stats,
    ))
}

/// What one simulated loop measured, before the statistics.
struct SimTimeline {
    device: String,
    consumer: String,
    steps: u64,
    compute_ms: f64,
    loop_s: f64,
    /// Seconds waited at each step (the first batch excluded).
    waits: Vec<f64>,
    by_second: Vec<f64>,
    startup_s: f64,
    payload: u64,
}

fn sim_report(t: SimTimeline, stats: LoaderStats) -> SimRun {
    let wait: f64 = t.waits.iter().sum();
    let mut sorted = t.waits.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        sorted
            .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
            * 1e3
    };
    SimRun {
        device: t.device,
        consumer: t.consumer,
        steps: t.steps,
        compute_ms_per_batch: t.compute_ms,
        read_ms_per_batch: 0.0,
        raw_read_ms_per_batch: 0.0,
        loop_seconds: t.loop_s,
        wait_seconds: wait,
        wait_fraction: wait / t.loop_s.max(1e-12),
        wait_p50_ms: pct(0.5),
        wait_p99_ms: pct(0.99),
        wait_max_ms: sorted.last().copied().unwrap_or(0.0) * 1e3,
        waits_over_1ms: t.waits.iter().filter(|&&w| w > 1e-3).count() as u64,
        wait_ms_by_second: t.by_second,
        startup_ms: t.startup_s * 1e3,
        consumed_gbps: t.payload as f64 / t.loop_s.max(1e-12) / 1e9,
        ceiling_after_gbps: 0.0,
        stats,
    }
}

const SIM_SRC: crate::core::cuda::jit::KernelSource =
    crate::kernel_source!("data_sim", "kernels/sim_compute.cu");

/// The simulated step's GPU "compute" kernel (compiled by `ferrite kernels` with the families').
pub fn sim_program() -> crate::core::cuda::jit::Program {
    crate::core::cuda::jit::Program::new(SIM_SRC)
}

/// The simulated loop as a GPU training step sees it: the host queues, per step, the stream's
/// wait on the batch's copy (`next_batch_on`), then a kernel that keeps the compute stream busy
/// `compute_ms`, between two events, and never synchronises; the loader can run at most its
/// ring ahead (a slot is refilled only once the step that read it is over). The wait is the
/// stream's idle time between one step's kernel and the next — what a real GPU step would lose
/// to data — so the host's own per-call costs (a few µs, overlapped with the GPU's queue in a real
/// loop) are not counted, unlike the host-synchronous loop above.
pub fn sim_run_gpu(
    ds: &Dataset,
    cfg: &BenchConfig,
    ordinal: usize,
    compute_ms: f64,
) -> Result<SimRun> {
    use crate::core::cuda::{device, GpuTimer, KernelArgs};
    let steps = cfg
        .sim_steps
        .max((cfg.sim_seconds * 1e3 / compute_ms.max(1e-6)).ceil() as u64);
    let es = ds.dtype().size_in_bytes() as u64;
    let dev = device(ordinal)?;
    let stream = dev.new_stream()?;
    let kernel = dev.kernel(&sim_program(), "sim_compute")?;
    let timers = (0..=steps)
        .map(|_| GpuTimer::new(&dev))
        .collect::<Result<Vec<_>>>()?;
    let ns = (compute_ms * 1e6).round().max(1.0) as u64;
    let mut l = Loader::new(ds, loader_config(cfg, Device::Cuda(ordinal), None), None)?;
    let t0 = Instant::now();
    let mut startup = 0.0;
    let mut payload = 0u64;
    for (step, timer) in timers.iter().enumerate() {
        let b = l
            .next_batch_on(&stream)?
            .ok_or_else(|| Error::Other("the loader ended during the simulated loop".into()))?;
        if step == 0 {
            startup = t0.elapsed().as_secs_f64();
        } else {
            payload += b.valid_rows as u64 * cfg.seq as u64 * es;
        }
        timer.start(&stream)?;
        let mut a = KernelArgs::new();
        a.push(ns);
        kernel.launch(&stream, (1, 1, 1), (32, 1, 1), 0, &mut a)?;
        timer.stop(&stream)?;
        drop(b);
    }
    dev.synchronize(&stream, "the simulated GPU loop")?;
    let stats = l.stats();
    drop(l);
    let mut waits = Vec::with_capacity(steps as usize);
    let mut by_second: Vec<f64> = Vec::new();
    let mut at_ms = 0.0;
    for w in timers.windows(2) {
        let gap = w[0].gap_ms(&w[1])?;
        let sec = (at_ms / 1e3) as usize;
        if by_second.len() <= sec {
            by_second.resize(sec + 1, 0.0);
        }
        by_second[sec] += gap;
        at_ms += gap + w[1].elapsed_ms()?;
        waits.push(gap / 1e3);
    }
    Ok(sim_report(
        SimTimeline {
            device: Device::Cuda(ordinal).to_string(),
            consumer: "GPU stream (idle time between compute kernels)".into(),
            steps,
            compute_ms,
            loop_s: at_ms / 1e3,
            waits,
            by_second,
            startup_s: startup,
            payload,
        },
        stats,
    ))
}

fn summarise(runs: &[LoaderRun], device: &str, sweep_max: f64) -> Option<LoaderSummary> {
    let r: Vec<&LoaderRun> = runs.iter().filter(|r| r.device == device).collect();
    if r.is_empty() {
        return None;
    }
    let col = |f: &dyn Fn(&LoaderRun) -> f64| r.iter().map(|x| f(x)).collect::<Vec<_>>();
    let ratios = col(&|x| x.ratio);
    let gbps = median(&col(&|x| x.gbps));
    Some(LoaderSummary {
        device: device.into(),
        runs: r.len(),
        gbps,
        ceiling_gbps: median(&col(&|x| x.ceiling_gbps)),
        ratio: median(&ratios),
        ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratio_max: ratios.iter().copied().fold(0.0, f64::max),
        ratio_vs_sweep_max: gbps / sweep_max.max(1e-12),
        cores_per_gbps: median(&col(&|x| x.cores_per_gbps)),
    })
}

/// All phases.
impl BenchConfig {
    /// Every numeric setting in range, checked before any read or allocation (a zero request
    /// size would never advance; a huge read-ahead would abort the process allocating it).
    pub fn validate(&self) -> Result<()> {
        let bad =
            |arg: &str, exp: &str, got: String| Err(Error::bad_arg("data bench", arg, exp, got));
        let req_ok = |r: usize| r > 0 && r.is_multiple_of(4096) && r <= 1 << 30;
        if !req_ok(self.io.request_bytes) {
            return bad(
                "--request-kib",
                "a multiple of 4 KiB in 4..=1048576 KiB",
                (self.io.request_bytes / 1024).to_string(),
            );
        }
        if let Some(r) = self.ceiling_requests.iter().find(|&&r| !req_ok(r)) {
            return bad(
                "--ceiling-kib",
                "multiples of 4 KiB in 4..=1048576 KiB",
                (r / 1024).to_string(),
            );
        }
        if self.io.queue_depth == 0 || self.io.queue_depth > 4096 {
            return bad("--queue-depth", "1..=4096", self.io.queue_depth.to_string());
        }
        if let Some(q) = self.ceiling_depths.iter().find(|&&q| q == 0 || q > 4096) {
            return bad("--ceiling-qd", "values in 1..=4096", q.to_string());
        }
        if !(self.compute_factor.is_finite() && (0.0..=1000.0).contains(&self.compute_factor)) {
            return bad(
                "--compute-factor",
                "a finite number in [0, 1000]",
                self.compute_factor.to_string(),
            );
        }
        if !(self.sim_seconds.is_finite() && (0.0..=86400.0).contains(&self.sim_seconds)) {
            return bad(
                "--sim-seconds",
                "a finite number of seconds in [0, 86400]",
                self.sim_seconds.to_string(),
            );
        }
        if self.read_ahead == 0 || self.read_ahead > 1024 {
            return bad(
                "--read-ahead",
                "1..=1024 windows",
                self.read_ahead.to_string(),
            );
        }
        if self.prefetch == 0 || self.prefetch > 1024 {
            return bad("--prefetch", "1..=1024 batches", self.prefetch.to_string());
        }
        if self.rounds == 0 || self.sweep_repeats == 0 {
            return bad(
                "--rounds/--sweep-repeats",
                "both ≥ 1",
                format!("{}/{}", self.rounds, self.sweep_repeats),
            );
        }
        Ok(())
    }
}

pub fn run(ds: &Dataset, cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport> {
    cfg.validate()?;
    let total = ds.total_bytes();
    let warmup = if cfg.warmup {
        progress("warm-up pass over the data (not counted)");
        Some(raw_read(ds, 1 << 20, 32, EngineKind::Auto, 0, 0)?)
    } else {
        None
    };
    // The sweep: each sample reads another part of the data (a part read just before may still
    // sit in a cache below the VM), and the second pass runs the points in reverse order so that
    // a slow or fast stretch of the disk does not favour one end of the list.
    let mut points: Vec<SweepPoint> = Vec::new();
    for &req in &cfg.ceiling_requests {
        for &qd in &cfg.ceiling_depths {
            if req as u64 * qd as u64 > 1 << 30 || req == 0 || !req.is_multiple_of(ALIGN) {
                continue; // keep the buffers in flight under 1 GiB; O_DIRECT sizes only
            }
            points.push(SweepPoint {
                request_bytes: req,
                queue_depth: qd,
                gbps: Vec::new(),
                mean_gbps: 0.0,
            });
        }
    }
    let sweep_bytes = if cfg.sweep_bytes == 0 {
        total
    } else {
        cfg.sweep_bytes.min(total)
    };
    let mut start = 0u64;
    for rep in 0..cfg.sweep_repeats.max(1) {
        let n = points.len();
        for k in 0..n {
            let i = if rep % 2 == 0 { k } else { n - 1 - k };
            let p = &mut points[i];
            progress(&format!(
                "sweep {}/{}: raw O_DIRECT read, {} KiB × {} in flight",
                rep + 1,
                cfg.sweep_repeats.max(1),
                p.request_bytes / 1024,
                p.queue_depth
            ));
            let c = raw_read(
                ds,
                p.request_bytes,
                p.queue_depth,
                EngineKind::Auto,
                start,
                sweep_bytes,
            )?;
            p.gbps.push(c.gbps);
            start = (start + sweep_bytes) % total.max(1);
        }
    }
    for p in &mut points {
        p.mean_gbps = p.gbps.iter().sum::<f64>() / p.gbps.len().max(1) as f64;
    }
    let sweep_max_gbps = points
        .iter()
        .flat_map(|p| p.gbps.iter().copied())
        .fold(0.0, f64::max);
    let best = points
        .iter()
        .max_by(|a, b| a.mean_gbps.total_cmp(&b.mean_gbps))
        .map(|p| (p.request_bytes, p.queue_depth));
    let mut cfg = cfg.clone();
    if let Some((req, qd)) = best {
        if !cfg.fixed_request {
            cfg.io.request_bytes = req;
        }
        if !cfg.fixed_depth {
            cfg.io.queue_depth = qd;
        }
    }
    let config_from = match (best.is_some(), cfg.fixed_request, cfg.fixed_depth) {
        (false, false, false) => "the defaults (no sweep point ran)",
        (false, _, _) | (true, true, true) => "fixed by the user",
        (true, false, false) => "the sweep's best mean",
        (true, true, false) => "read size fixed by the user, depth from the sweep",
        (true, false, true) => "depth fixed by the user, read size from the sweep",
    }
    .to_string();
    // The ceiling at the loader's own configuration (a pread pool holds 2 reads per thread).
    let (req, qd) = (
        cfg.io.request_bytes,
        match cfg.io.engine {
            EngineKind::Auto => cfg.io.queue_depth,
            EngineKind::Pread => (cfg.io.threads.max(1) * 2) as u32,
        },
    );
    let ceiling = |progress: &mut dyn FnMut(&str), what: &str| {
        progress(&format!(
            "raw O_DIRECT read at the loader's {} KiB × {qd} ({what})",
            req / 1024
        ));
        raw_read(ds, req, qd, EngineKind::Auto, 0, cfg.max_bytes)
    };
    let mut devices = vec![Device::Cpu];
    if let Some(i) = cfg.gpu {
        devices.push(Device::Cuda(i));
    }
    let mut paired = vec![ceiling(progress, "first")?];
    let mut runs = Vec::new();
    for round in 0..cfg.rounds.max(1) {
        for &dev in &devices {
            progress(&format!(
                "round {}/{}: loader → {}",
                round + 1,
                cfg.rounds.max(1),
                if dev.is_cuda() { "GPU" } else { "host" }
            ));
            let mut r = loader_run(ds, &cfg, dev)?;
            let c = ceiling(progress, "after the loader")?;
            r.ceiling_before_gbps = paired.last().map_or(0.0, |p: &CeilingPoint| p.gbps);
            r.ceiling_after_gbps = c.gbps;
            r.ceiling_gbps = (r.ceiling_before_gbps + r.ceiling_after_gbps) / 2.0;
            r.ratio = r.gbps / r.ceiling_gbps.max(1e-12);
            r.read_ratio = r.read_gbps / r.ceiling_gbps.max(1e-12);
            paired.push(c);
            runs.push(r);
        }
    }
    let host = summarise(&runs, &Device::Cpu.to_string(), sweep_max_gbps);
    let gpu = cfg
        .gpu
        .and_then(|i| summarise(&runs, &Device::Cuda(i).to_string(), sweep_max_gbps));
    let batch_bytes = (cfg.batch * cfg.seq * ds.dtype().size_in_bytes()) as f64;
    let mut sim = Vec::new();
    for s in [&host, &gpu].into_iter().flatten() {
        let dev = devices
            .iter()
            .copied()
            .find(|d| d.to_string() == s.device)
            .unwrap_or(Device::Cpu);
        let read_ms = batch_bytes / (s.gbps.max(1e-12) * 1e9) * 1e3;
        progress(&format!(
            "simulated training loop ({}), ≥ {} s",
            s.device, cfg.sim_seconds
        ));
        let mut loops = vec![sim_run(ds, &cfg, dev, read_ms * cfg.compute_factor)?];
        if let Device::Cuda(i) = dev {
            progress(&format!(
                "simulated training loop ({}, GPU compute), ≥ {} s",
                s.device, cfg.sim_seconds
            ));
            loops.push(sim_run_gpu(ds, &cfg, i, read_ms * cfg.compute_factor)?);
        }
        for mut r in loops {
            r.read_ms_per_batch = read_ms;
            r.raw_read_ms_per_batch = batch_bytes / (s.ceiling_gbps.max(1e-12) * 1e9) * 1e3;
            r.ceiling_after_gbps = ceiling(progress, "after the simulated loop")?.gbps;
            sim.push(r);
        }
    }
    Ok(BenchReport {
        dataset: ds.summary(Some(cfg.seq as u64)),
        dataset_bytes: total,
        batch: cfg.batch,
        seq: cfg.seq,
        warmup,
        sweep: points,
        sweep_max_gbps,
        request_bytes: cfg.io.request_bytes,
        queue_depth: qd,
        config_from,
        raw_cores_per_gbps: median(&paired.iter().map(|c| c.cores_per_gbps).collect::<Vec<_>>()),
        paired_ceiling: paired,
        runs,
        host,
        gpu,
        sim,
    })
}

/// Writes `bytes` of random u16 tokens as ferrite shards of `shard_bytes` each (with an index),
/// streaming, so any size fits in memory. Returns the files written (shards, then the index), so
/// a caller that cleans up removes exactly those.
pub fn synthetic(
    dir: &Path,
    bytes: u64,
    shard_bytes: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let mut written = Vec::new();
    let total_tokens = bytes / 2;
    let per_shard = (shard_bytes / 2).max(1);
    let mut entries = Vec::new();
    let mut t = 0u64;
    let mut buf = Vec::with_capacity(1 << 20);
    while t < total_tokens {
        let n = per_shard.min(total_tokens - t);
        let p = dir.join(format!("shard_{:06}.ftok", entries.len()));
        written.push(p.clone());
        let mut w = ShardWriter::create(
            &p,
            ShardFormat::Ferrite,
            DType::U16,
            DEFAULT_CHUNK_BYTES,
            GPT2_VOCAB,
        )?;
        let mut left = n;
        while left > 0 {
            let k = left.min(1 << 20);
            buf.clear();
            buf.extend((0..k).map(|i| (mix64(t + i) % GPT2_VOCAB as u64) as u32));
            w.push(&buf)?;
            t += k;
            left -= k;
            progress(t * 2, bytes);
        }
        entries.push(w.finish()?);
    }
    let index = super::format::Index {
        format: super::format::INDEX_FORMAT.into(),
        version: super::format::INDEX_VERSION,
        tokenizer: "synthetic".into(),
        vocab_size: GPT2_VOCAB,
        eot_token: None,
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        total_tokens,
        shards: entries,
    };
    let ip = dir.join(super::format::INDEX_FILE);
    index.write(&ip)?;
    written.push(ip);
    Ok(written)
}
