//! `ferrite data`: pack text into token shards, inspect and verify shards, bench the loader.

use clap::{Args, Subcommand};
use ferrite::core::cuda;
use ferrite::data::bench::{self, BenchConfig};
use ferrite::data::format::{verify_shard, ShardFormat, DEFAULT_CHUNK_BYTES};
use ferrite::data::{
    pack_files, Dataset, EngineKind, IoConfig, Loader, LoaderConfig, PackConfig, Remainder,
};
use ferrite::{DType, Device, Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum DataCmd {
    /// Tokenize text files (GPT-2 BPE) into shards plus an index.json.
    Pack(PackArgs),
    /// Validate shards (headers, index, checksums) and print what they hold.
    Inspect(InspectArgs),
    /// Raw O_DIRECT read ceiling, loader throughput to host/GPU, simulated training loop.
    Bench(BenchArgs),
}

#[derive(Args)]
pub struct PackArgs {
    /// Text files (.txt: one document each; .jsonl: one {"text": ...} per line) or folders of them
    /// (walked recursively, in name order).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output folder.
    #[arg(short, long)]
    out: PathBuf,
    /// ferrite (.ftok), llmc (llm.c v1 .bin, u16) or llmc7 (llm.c v7 .bin, u32).
    #[arg(long, default_value = "ferrite")]
    format: String,
    /// Token dtype of ferrite shards: u16 or u32 (default u16; llm.c's formats fix their own).
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens per shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: u64,
    /// Checksum chunk size in bytes (a multiple of 4096).
    #[arg(long, default_value_t = DEFAULT_CHUNK_BYTES)]
    chunk_bytes: u64,
}

#[derive(Args)]
pub struct InspectArgs {
    /// A packed folder, an index.json, or shard files.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Read every byte and check every checksum.
    #[arg(long)]
    verify: bool,
    /// Also print the first batch of a loader with this B×T (e.g. 2x16).
    #[arg(long)]
    peek: Option<String>,
}

#[derive(Args)]
pub struct BenchArgs {
    /// A packed folder (or index.json / shard files). With --synthetic, where to write the data.
    path: PathBuf,
    /// Write this many GB of random tokens to PATH first (1 GB shards).
    #[arg(long)]
    synthetic: Option<f64>,
    /// Delete the synthetic data afterwards (only the files this run wrote, and PATH if the run
    /// created it).
    #[arg(long)]
    cleanup: bool,
    /// Let --synthetic write into a PATH that already holds files (shards or an index of the
    /// same names are overwritten).
    #[arg(long)]
    force: bool,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// io_uring queue depth of the loader (default: the sweep's best).
    #[arg(long)]
    queue_depth: Option<u32>,
    /// Skip the loader's chunk checksum verification (to measure its cost).
    #[arg(long)]
    no_verify: bool,
    /// Verified windows (64 MiB each) the loader queues ahead of its assembler.
    #[arg(long, default_value_t = 4)]
    read_ahead: usize,
    /// Batches the loader assembles ahead of the consumer. The simulated steps last well under
    /// a millisecond, so the queue is sized in time (16 × ~0.4 ms) rather than left at the
    /// library's default of 4, which suits real steps (tens of ms and more).
    #[arg(long, default_value_t = 16)]
    prefetch: usize,
    /// pread pool threads (the fallback).
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Loader read size in KiB (default: the sweep's best).
    #[arg(long)]
    request_kib: Option<usize>,
    /// auto (io_uring + O_DIRECT, fallback pread) or pread.
    #[arg(long, default_value = "auto")]
    engine: String,
    /// Read sizes (KiB) tried by the sweep.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    ceiling_kib: Vec<usize>,
    /// Queue depths tried by the sweep.
    #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
    ceiling_qd: Vec<u32>,
    /// GB read per sweep sample (0: the whole data set).
    #[arg(long, default_value_t = 1.0)]
    sweep_gb: f64,
    /// Passes over the sweep's points (alternating order; each point's mean decides).
    #[arg(long, default_value_t = 2)]
    sweep_repeats: usize,
    /// Loader runs per device, each between two ceiling passes at the loader's configuration.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Stop each loader run and paired ceiling pass after this many GB (0: the whole data set).
    #[arg(long, default_value_t = 0.0)]
    max_gb: f64,
    /// Skip the first, uncounted pass over the data.
    #[arg(long)]
    no_warmup: bool,
    /// Load in shard order (sequential reads) instead of shuffled: isolates the cost of the
    /// shuffled access pattern.
    #[arg(long)]
    no_shuffle: bool,
    /// Simulated compute per batch, as a multiple of the loader's measured time per batch.
    #[arg(long, default_value_t = 1.2)]
    compute_factor: f64,
    /// Minimum steps of the simulated training loop (after the first batch).
    #[arg(long, default_value_t = 2000)]
    sim_steps: u64,
    /// Minimum seconds of the simulated training loop.
    #[arg(long, default_value_t = 8.0)]
    sim_seconds: f64,
    /// The simulated compute sleeps instead of spinning (for machines with few cores).
    #[arg(long)]
    sim_sleep: bool,
    /// cpu, or cuda / cuda:N to include the GPU phases (default: cuda:0 when present).
    #[arg(long)]
    device: Option<String>,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{what} [{{elapsed_precise}}] {{wide_bar}} {{bytes}}/{{total_bytes}} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// The text files to pack: files as given, folders walked recursively (each folder's entries in
/// name order, so the corpus order is stable); files that are neither .txt nor .jsonl are
/// skipped and counted on stderr, and finding no input at all is an error.
fn inputs(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>, skipped: &mut Vec<PathBuf>) -> Result<()> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        v.sort();
        for f in v {
            if f.is_dir() {
                walk(&f, out, skipped)?;
            } else if f.extension().is_some_and(|e| e == "txt" || e == "jsonl") {
                out.push(f);
            } else {
                skipped.push(f);
            }
        }
        Ok(())
    }
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for p in paths {
        if p.is_dir() {
            walk(p, &mut out, &mut skipped)?;
        } else {
            out.push(p.clone());
        }
    }
    if !skipped.is_empty() {
        eprintln!(
            "note: skipped {} file(s) that are neither .txt nor .jsonl (first: {})",
            skipped.len(),
            skipped[0].display()
        );
    }
    if out.is_empty() {
        return Err(Error::bad_arg(
            "data pack",
            "INPUTS",
            ".txt or .jsonl files, or folders holding some",
            format!("{} path(s) with none", paths.len()),
        ));
    }
    Ok(out)
}

fn pack(a: PackArgs) -> Result<()> {
    let format = match a.format.as_str() {
        "ferrite" => ShardFormat::Ferrite,
        "llmc" | "llmc1" => ShardFormat::LlmcV1,
        "llmc7" => ShardFormat::LlmcV7,
        f => {
            return Err(Error::bad_arg(
                "data pack",
                "--format",
                "ferrite, llmc or llmc7",
                f,
            ))
        }
    };
    let dtype = match (a.dtype.as_deref(), format) {
        (None | Some("u16"), ShardFormat::Ferrite) => DType::U16,
        (Some("u32"), ShardFormat::Ferrite) => DType::U32,
        (Some(d), ShardFormat::Ferrite) => {
            return Err(Error::bad_arg("data pack", "--dtype", "u16 or u32", d))
        }
        // llm.c's formats carry their dtype in the format itself (v1 u16, v7 u32).
        (Some(d), _) => {
            return Err(Error::bad_arg(
                "data pack",
                "--dtype",
                "no --dtype with --format llmc (u16) or llmc7 (u32): the format fixes it",
                d,
            ))
        }
        (None, _) => DType::U16,
    };
    let files = inputs(&a.inputs)?;
    let cfg = PackConfig {
        out_dir: a.out.clone(),
        format,
        dtype,
        shard_tokens: a.shard_tokens,
        chunk_bytes: a.chunk_bytes,
        ..PackConfig::default()
    };
    let pb = bar(0, "packing");
    let s = pack_files(&files, &cfg, &mut |done, total, toks| {
        pb.set_length(total);
        pb.set_position(done);
        pb.set_message(format!("{toks} tokens"));
    })?;
    pb.finish_and_clear();
    println!(
        "packed {} files ({} documents, {:.2} MB) into {} tokens in {} {} shards under {} in {:.2} s ({:.2} MB/s)",
        s.files,
        s.documents,
        s.input_bytes as f64 / 1e6,
        s.tokens,
        s.shards,
        format.name(),
        a.out.display(),
        s.seconds,
        s.input_bytes as f64 / 1e6 / s.seconds
    );
    println!("index: {}", s.index.display());
    Ok(())
}

fn open(paths: &[PathBuf]) -> Result<Dataset> {
    if paths.len() == 1 {
        Dataset::open(&paths[0])
    } else {
        Dataset::from_paths(paths)
    }
}

fn inspect(a: InspectArgs) -> Result<()> {
    let ds = open(&a.paths)?;
    println!("{}", ds.summary(None));
    for (i, s) in ds.shards.iter().enumerate() {
        println!(
            "  {:>4} {}  {}  {} tokens ({})  payload at byte {}",
            i,
            s.path.display(),
            s.header.format.name(),
            s.header.tokens,
            s.header.dtype,
            s.header.payload_offset
        );
    }
    if a.verify {
        let pb = bar(ds.total_bytes(), "verifying");
        for (i, s) in ds.shards.iter().enumerate() {
            let entry = ds.index.as_ref().map(|x| &x.shards[i]);
            verify_shard(&s.path, entry, ds.chunk_bytes)?;
            pb.inc(s.file_bytes);
        }
        pb.finish_and_clear();
        println!(
            "verified {} shards: headers{}",
            ds.shards.len(),
            if ds.checksummed() {
                ", index and every payload checksum"
            } else {
                " (no index: payload not checksummed)"
            }
        );
    }
    if let Some(p) = a.peek {
        let (b, t) = p
            .split_once('x')
            .and_then(|(b, t)| Some((b.parse().ok()?, t.parse().ok()?)))
            .ok_or_else(|| Error::bad_arg("data inspect", "--peek", "BxT, e.g. 2x16", &p))?;
        let mut l = Loader::new(
            &ds,
            LoaderConfig {
                batch: b,
                seq: t,
                epochs: Some(1),
                remainder: Remainder::Pad,
                ..LoaderConfig::default()
            },
            None,
        )?;
        if let Some(batch) = l.next_batch()? {
            println!(
                "first batch (epoch {}, samples {:?}):",
                batch.epoch, batch.samples
            );
            let v = batch.tokens.to_f64_vec()?;
            for row in v.chunks(t + 1) {
                println!("  {:?}", row.iter().map(|&x| x as u32).collect::<Vec<_>>());
            }
            println!(
                "state after it: {}",
                serde_json::to_string(&batch.state_after).unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    // What --synthetic wrote (and whether it created PATH), for --cleanup to remove exactly that.
    let mut written = Vec::new();
    let mut created_dir = false;
    if let Some(gb) = a.synthetic {
        if !(gb > 0.0 && gb.is_finite()) {
            return Err(Error::bad_arg(
                "data bench",
                "--synthetic",
                "a size in GB > 0",
                gb,
            ));
        }
        let occupied = match std::fs::read_dir(&a.path) {
            Ok(mut it) => it.next().is_some(),
            Err(_) => false,
        };
        if a.path.exists() && !a.path.is_dir() {
            return Err(Error::bad_arg(
                "data bench",
                "PATH",
                "a folder for the synthetic shards",
                format!("{} (a file)", a.path.display()),
            ));
        }
        if occupied && !a.force {
            return Err(Error::bad_arg(
                "data bench",
                "PATH",
                "an empty or new folder for --synthetic (or --force to write into it)",
                format!("{}, which already holds files", a.path.display()),
            ));
        }
        created_dir = !a.path.exists();
        let bytes = (gb * 1e9) as u64;
        let pb = bar(bytes, "writing synthetic shards");
        written = bench::synthetic(&a.path, bytes, 1 << 30, &mut |d, _| pb.set_position(d))?;
        pb.finish_and_clear();
    }
    let gpu = match a.device.as_deref() {
        None => cuda::availability().ok().map(|_| 0),
        Some(s) => match Device::parse(s)? {
            Device::Cpu => None,
            Device::Cuda(i) => {
                cuda::device(i)?;
                Some(i)
            }
        },
    };
    let engine = match a.engine.as_str() {
        "auto" => EngineKind::Auto,
        "pread" => EngineKind::Pread,
        e => return Err(Error::bad_arg("data bench", "--engine", "auto or pread", e)),
    };
    let ds = Dataset::open(&a.path)?;
    let cfg = BenchConfig {
        batch: a.batch,
        seq: a.seq,
        io: IoConfig {
            engine,
            queue_depth: a.queue_depth.unwrap_or(64),
            threads: a.threads,
            direct: true,
            request_bytes: a.request_kib.unwrap_or(4096) * 1024,
        },
        fixed_request: a.request_kib.is_some(),
        fixed_depth: a.queue_depth.is_some(),
        ceiling_requests: a.ceiling_kib.iter().map(|k| k * 1024).collect(),
        ceiling_depths: a.ceiling_qd.clone(),
        sweep_bytes: (a.sweep_gb * 1e9) as u64,
        sweep_repeats: a.sweep_repeats,
        rounds: a.rounds,
        max_bytes: (a.max_gb * 1e9) as u64,
        compute_factor: a.compute_factor,
        gpu,
        sim_steps: a.sim_steps,
        sim_seconds: a.sim_seconds,
        sim_sleep: a.sim_sleep,
        read_ahead: a.read_ahead,
        prefetch: a.prefetch,
        verify: !a.no_verify,
        warmup: !a.no_warmup,
        shuffle: !a.no_shuffle,
    };
    let pb = ProgressBar::new_spinner();
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    let r = bench::run(&ds, &cfg, &mut |m| pb.set_message(m.to_string()));
    pb.finish_and_clear();
    let r = r?;
    println!(
        "data: {} ({:.2} GB)",
        r.dataset,
        r.dataset_bytes as f64 / 1e9
    );
    if let Some(w) = &r.warmup {
        println!("warm-up pass (not counted): {:.2} GB/s", w.gbps);
    }
    println!("sweep: raw O_DIRECT reads (GB/s per sample, each on another part of the data):");
    for p in &r.sweep {
        let v: Vec<String> = p.gbps.iter().map(|g| format!("{g:.2}")).collect();
        println!(
            "  {:>5} KiB × {:>3}: mean {:5.2}  ({})",
            p.request_bytes / 1024,
            p.queue_depth,
            p.mean_gbps,
            v.join(", ")
        );
    }
    println!(
        "  best single sample: {:.2} GB/s; loader runs at {} KiB × {} ({})",
        r.sweep_max_gbps,
        r.request_bytes / 1024,
        r.queue_depth,
        r.config_from
    );
    for (i, l) in r.runs.iter().enumerate() {
        println!(
            "  run {:>2} → {:<6}: {:5.2} GB/s of tokens ({:.2} read) between ceilings {:.2} and {:.2} = {:3.0}%; first batch {:.0} ms; {:.2} cores = {:.2} per GB/s (CPU s: plan {:.2}, io {:.2}, verify {:.2}, assemble {:.2}; {} buffers)",
            i + 1,
            l.device,
            l.gbps,
            l.read_gbps,
            l.ceiling_before_gbps,
            l.ceiling_after_gbps,
            l.ratio * 100.0,
            l.first_batch_ms,
            l.cpu_cores,
            l.cores_per_gbps,
            l.stats.plan_s,
            l.stats.io_s,
            l.stats.verify_s,
            l.stats.assemble_s,
            l.stats.buffers
        );
    }
    for s in [&r.host, &r.gpu].into_iter().flatten() {
        println!(
            "loader → {}: {:.2} GB/s, {:.0}% of the same-configuration ceiling (median of {} runs, {:.0}–{:.0}%; ceiling median {:.2} GB/s); {:.0}% of the sweep's best sample; {:.2} cores per GB/s",
            s.device,
            s.gbps,
            s.ratio * 100.0,
            s.runs,
            s.ratio_min * 100.0,
            s.ratio_max * 100.0,
            s.ceiling_gbps,
            s.ratio_vs_sweep_max * 100.0,
            s.cores_per_gbps
        );
    }
    println!(
        "raw read alone: {:.2} cores per GB/s (median of the paired ceiling passes)",
        r.raw_cores_per_gbps
    );
    if let Some(l) = r.runs.first() {
        if let Some(f) = &l.fallback {
            println!("loader I/O: {} (fallback: {f})", l.io);
        } else {
            println!("loader I/O: {}", l.io);
        }
    }
    for s in &r.sim {
        println!(
            "simulated training ({}; waiting: {}): compute {:.3} ms/batch = {:.2} × the loader's {:.3} ms ({:.2} × the raw read's {:.3} ms), {} steps in {:.1} s: waited {:.3}% of the loop; per step p50 {:.3} ms, p99 {:.3} ms, max {:.1} ms, {} over 1 ms (startup {:.0} ms apart); ceiling right after {:.2} GB/s",
            s.device,
            s.consumer,
            s.compute_ms_per_batch,
            s.compute_ms_per_batch / s.read_ms_per_batch,
            s.read_ms_per_batch,
            s.compute_ms_per_batch / s.raw_read_ms_per_batch,
            s.raw_read_ms_per_batch,
            s.steps,
            s.loop_seconds,
            s.wait_fraction * 100.0,
            s.wait_p50_ms,
            s.wait_p99_ms,
            s.wait_max_ms,
            s.waits_over_1ms,
            s.startup_ms,
            s.ceiling_after_gbps
        );
        let v: Vec<String> = s
            .wait_ms_by_second
            .iter()
            .map(|w| format!("{w:.0}"))
            .collect();
        println!("  ms waited in each second of the loop: {}", v.join(" "));
    }
    if let Some(p) = &a.json {
        let s = serde_json::to_string_pretty(&r).map_err(|e| Error::Other(e.to_string()))?;
        std::fs::write(p, s).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
        println!("json: {}", p.display());
    }
    if a.cleanup && a.synthetic.is_some() {
        remove_synthetic(&a.path, &written, created_dir)?;
    }
    Ok(())
}

/// Removes the files a --synthetic run wrote, and the folder when the run created it (and it is
/// empty then); nothing else in the folder is touched.
fn remove_synthetic(dir: &Path, written: &[PathBuf], created_dir: bool) -> Result<()> {
    for p in written {
        std::fs::remove_file(p).map_err(|e| Error::io(format!("removing {}", p.display()), e))?;
    }
    if created_dir {
        // Fails (and is left alone) if anything else was put there meanwhile.
        let _ = std::fs::remove_dir(dir);
    }
    Ok(())
}

pub fn run(cmd: DataCmd) -> Result<bool> {
    match cmd {
        DataCmd::Pack(a) => pack(a),
        DataCmd::Inspect(a) => inspect(a),
        DataCmd::Bench(a) => bench_cmd(a),
    }
    .map(|_| true)
}
