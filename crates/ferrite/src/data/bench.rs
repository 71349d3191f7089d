//! `ferrite data bench`: the raw read ceiling of the files' device, the loader's throughput to the
//! host and to the GPU, and a simulated training loop's consumer wait — all in one run, so the
//! ratios compare like with like.

use super::format::{ShardFormat, ShardWriter, DEFAULT_CHUNK_BYTES};
use super::io::{self, AlignedBuf, EngineKind, Files, IoConfig, Req};
use super::loader::{Dataset, Loader, LoaderConfig};
use super::order::mix64;
use super::pack::GPT2_VOCAB;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use std::path::Path;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct CeilingPoint {
    pub request_bytes: usize,
    pub queue_depth: u32,
    pub engine: String,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LoaderRun {
    pub device: String,
    pub batches: u64,
    pub seconds: f64,
    /// Unique payload bytes delivered per second (T tokens per row: the file's rate).
    pub gbps: f64,
    /// Bytes read from the files per second (with alignment/chunk widening).
    pub read_gbps: f64,
    /// CPU time over wall time (all threads of the process).
    pub cpu_cores: f64,
    pub cores_per_gbps: f64,
    pub io: String,
    pub fallback: Option<String>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SimRun {
    pub device: String,
    pub steps: u64,
    pub compute_ms_per_batch: f64,
    pub read_ms_per_batch: f64,
    pub loop_seconds: f64,
    pub wait_seconds: f64,
    pub wait_fraction: f64,
    /// Time to the first batch (not counted in the wait fraction).
    pub startup_ms: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub dataset: String,
    pub dataset_bytes: u64,
    pub batch: usize,
    pub seq: usize,
    pub ceiling: Vec<CeilingPoint>,
    pub ceiling_gbps: f64,
    pub host: Option<LoaderRun>,
    pub host_ratio: Option<f64>,
    pub gpu: Option<LoaderRun>,
    pub gpu_ratio: Option<f64>,
    pub sim: Vec<SimRun>,
}

#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub batch: usize,
    pub seq: usize,
    pub io: IoConfig,
    /// Request sizes × queue depths tried for the ceiling.
    pub ceiling_requests: Vec<usize>,
    pub ceiling_depths: Vec<u32>,
    /// Stop each phase after this many bytes (0: the whole dataset once).
    pub max_bytes: u64,
    /// Simulated compute per batch = this × the loader's measured time per batch.
    pub compute_factor: f64,
    pub gpu: Option<usize>,
    pub sim_steps: u64,
    /// The simulated compute sleeps instead of spinning (frees the core on small machines; less
    /// precise).
    pub sim_sleep: bool,
    /// Windows the loader reads ahead.
    pub read_ahead: usize,
    /// Verify chunk checksums while loading.
    pub verify: bool,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF covers every thread of the process.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Reads the files front to back with `qd` reads of `req` bytes in flight (O_DIRECT through the
/// same engine setup the loader uses), up to `max_bytes`.
pub fn raw_read(
    ds: &Dataset,
    req: usize,
    qd: u32,
    engine: EngineKind,
    max_bytes: u64,
) -> Result<CeilingPoint> {
    let paths: Vec<_> = ds.shards.iter().map(|s| s.path.clone()).collect();
    let sizes: Vec<_> = ds.shards.iter().map(|s| s.file_bytes).collect();
    let mut files = Files::open(&paths, &sizes)?;
    let cfg = IoConfig {
        engine,
        queue_depth: qd,
        threads: qd as usize,
        direct: true,
        request_bytes: req,
    };
    let mut bufs: Vec<AlignedBuf> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut setup = io::setup(&cfg, &mut files);
    let engine = &mut setup.engine;
    let slots = engine.capacity();
    for i in 0..slots {
        bufs.push(AlignedBuf::new(req));
        free.push(i);
    }
    let mut todo = Vec::new();
    let mut total = 0u64;
    'plan: for (i, &size) in sizes.iter().enumerate() {
        let mut off = 0;
        while off < size {
            todo.push((i, off, ((size - off) as usize).min(req)));
            total += ((size - off) as usize).min(req) as u64;
            off += req as u64;
            if max_bytes > 0 && total >= max_bytes {
                break 'plan;
            }
        }
    }
    todo.reverse();
    let t0 = Instant::now();
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
    Ok(CeilingPoint {
        request_bytes: req,
        queue_depth: qd,
        engine: setup.description.clone(),
        bytes: got,
        seconds: secs,
        gbps: got as f64 / secs / 1e9,
    })
}

/// Runs the loader (one rank, shuffled) until `max_bytes` of payload are delivered or the epoch
/// ends; the consumer touches nothing but the batch handle.
pub fn loader_run(ds: &Dataset, cfg: &BenchConfig, device: Device) -> Result<LoaderRun> {
    let lc = LoaderConfig {
        batch: cfg.batch,
        seq: cfg.seq,
        epochs: Some(1),
        device,
        io: cfg.io.clone(),
        read_ahead: cfg.read_ahead,
        verify: cfg.verify,
        ..LoaderConfig::default()
    };
    let es = ds.dtype().size_in_bytes() as u64;
    let mut l = Loader::new(ds, lc, None)?;
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let mut payload = 0u64;
    while let Some(b) = l.next_batch()? {
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
        gbps,
        read_gbps: st.bytes_read as f64 / secs / 1e9,
        cpu_cores: cpu / secs,
        cores_per_gbps: cpu / secs / gbps.max(1e-12),
        io: st.io,
        fallback: st.fallback,
    })
}

fn spin(d: std::time::Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// A training loop that "computes" `compute_ms` per batch (a spin on the host, after the batch's
/// copy has landed for GPU batches) and measures how long it waited for data.
pub fn sim_run(ds: &Dataset, cfg: &BenchConfig, device: Device, read_ms: f64) -> Result<SimRun> {
    let lc = LoaderConfig {
        batch: cfg.batch,
        seq: cfg.seq,
        device,
        io: cfg.io.clone(),
        read_ahead: cfg.read_ahead,
        verify: cfg.verify,
        ..LoaderConfig::default()
    };
    let compute_ms = read_ms * cfg.compute_factor;
    let mut l = Loader::new(ds, lc, None)?;
    let t0 = Instant::now();
    let mut wait = 0.0;
    let mut startup = 0.0;
    let mut loop_start = t0;
    for step in 0..=cfg.sim_steps {
        let w0 = Instant::now();
        let b = l
            .next_batch()?
            .ok_or_else(|| Error::Other("dataset ended during the simulated loop".into()))?;
        if device.is_cuda() {
            let dev = b.tokens.cuda_device()?;
            dev.synchronize(dev.stream(), "sim loop")?;
        }
        let waited = w0.elapsed().as_secs_f64();
        if step == 0 {
            startup = waited;
            loop_start = Instant::now();
        } else {
            wait += waited;
        }
        let d = std::time::Duration::from_secs_f64(compute_ms / 1e3);
        if cfg.sim_sleep {
            std::thread::sleep(d);
        } else {
            spin(d);
        }
        drop(b);
    }
    let loop_s = loop_start.elapsed().as_secs_f64();
    Ok(SimRun {
        device: device.to_string(),
        steps: cfg.sim_steps,
        compute_ms_per_batch: compute_ms,
        read_ms_per_batch: read_ms,
        loop_seconds: loop_s,
        wait_seconds: wait,
        wait_fraction: wait / loop_s,
        startup_ms: startup * 1e3,
    })
}

/// All phases.
pub fn run(ds: &Dataset, cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<BenchReport> {
    let mut ceiling = Vec::new();
    for &req in &cfg.ceiling_requests {
        for &qd in &cfg.ceiling_depths {
            if req as u64 * qd as u64 > 1 << 30 {
                continue; // keep the buffers in flight under 1 GiB
            }
            progress(&format!(
                "raw O_DIRECT read, {} KiB × {qd} in flight",
                req / 1024
            ));
            ceiling.push(raw_read(ds, req, qd, EngineKind::Auto, cfg.max_bytes)?);
        }
    }
    let ceiling_gbps = ceiling.iter().map(|c| c.gbps).fold(0.0, f64::max);
    progress("loader → host");
    let host = loader_run(ds, cfg, Device::Cpu)?;
    let batch_bytes = (cfg.batch * cfg.seq * ds.dtype().size_in_bytes()) as f64;
    let read_ms = batch_bytes / (host.gbps * 1e9) * 1e3;
    let mut sim = Vec::new();
    progress("simulated training loop (host)");
    sim.push(sim_run(ds, cfg, Device::Cpu, read_ms)?);
    let mut gpu = None;
    if let Some(i) = cfg.gpu {
        progress("loader → GPU");
        let g = loader_run(ds, cfg, Device::Cuda(i))?;
        let read_ms = batch_bytes / (g.gbps * 1e9) * 1e3;
        progress("simulated training loop (GPU)");
        sim.push(sim_run(ds, cfg, Device::Cuda(i), read_ms)?);
        gpu = Some(g);
    }
    Ok(BenchReport {
        dataset: ds.summary(Some(cfg.seq as u64)),
        dataset_bytes: ds.total_bytes(),
        batch: cfg.batch,
        seq: cfg.seq,
        ceiling_gbps,
        host_ratio: Some(host.gbps / ceiling_gbps),
        gpu_ratio: gpu.as_ref().map(|g| g.gbps / ceiling_gbps),
        ceiling,
        host: Some(host),
        gpu,
        sim,
    })
}

/// Writes `bytes` of random u16 tokens as ferrite shards of `shard_bytes` each (with an index),
/// streaming, so any size fits in memory.
pub fn synthetic(
    dir: &Path,
    bytes: u64,
    shard_bytes: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let total_tokens = bytes / 2;
    let per_shard = (shard_bytes / 2).max(1);
    let mut entries = Vec::new();
    let mut t = 0u64;
    let mut buf = Vec::with_capacity(1 << 20);
    while t < total_tokens {
        let n = per_shard.min(total_tokens - t);
        let p = dir.join(format!("shard_{:06}.ftok", entries.len()));
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
    index.write(&dir.join(super::format::INDEX_FILE))
}
