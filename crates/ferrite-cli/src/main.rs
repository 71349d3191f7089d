//! `ferrite`: check, bench and build the op ladders from the command line.

mod data_cmd;
mod train_cmd;

use clap::{Args, Parser, Subcommand};
use ferrite::core::cuda::{self, jit};
use ferrite::core::harness::report::{
    bench_summary, bench_table, check_table, ladder_svg, sweep_summary, sweep_svg, Table,
};
use ferrite::core::harness::{BenchConfig, CheckConfig, Timing};
use ferrite::core::rng::Rng;
use ferrite::ops::matmul::sweep::DEFAULT_ROW;
use ferrite::{ops, Arch, DType, Device, Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "ferrite",
    version,
    about = "Deep-learning ops as ladders of named variants: check them, bench them, build their kernels"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Devices, CUDA/NVRTC status, op families and their variants.
    Info,
    /// Correctness of every variant against an f64 reference on fresh random inputs.
    Check(CheckArgs),
    /// Time every variant, with the machine's ceilings and the vendor/peer library in the same run.
    Bench(BenchArgs),
    /// Compile every kernel for the given architectures (no GPU needed) and report resources.
    Kernels(KernelArgs),
    /// Token data: pack text into shards, inspect them, bench the streaming loader.
    #[command(subcommand)]
    Data(data_cmd::DataCmd),
    /// Train a GPT from token shards (explicit forward/backward over ferrite's ops).
    Train(Box<train_cmd::TrainArgs>),
    /// Generate text from a `ferrite train` checkpoint (paged KV cache, top-k/top-p sampling).
    Sample(train_cmd::SampleArgs),
}

#[derive(Args)]
struct Common {
    /// Op family, or `all`.
    #[arg(default_value = "all")]
    op: String,
    /// cpu, cuda, cuda:N or all (default: every device present).
    #[arg(long, default_value = "all")]
    device: String,
    /// Only these variants (repeatable).
    #[arg(long = "variant")]
    variants: Vec<String>,
    /// Only these dtypes (repeatable): f32, f16, bf16.
    #[arg(long = "dtype")]
    dtypes: Vec<String>,
    /// Fewer, smaller cases.
    #[arg(long)]
    quick: bool,
    /// Write the records as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    common: Common,
    /// Input seed (fresh every run when not given).
    #[arg(long)]
    seed: Option<u64>,
    /// Print each record to stderr as it is made, with the seconds since the start (the table
    /// comes only at the end: under a time limit this shows how far a check got, and its pace).
    #[arg(long)]
    trace: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    common: Common,
    /// Square problem size (matmul: N×N×N).
    #[arg(long, conflicts_with_all = ["m", "n", "k"])]
    size: Vec<usize>,
    #[arg(long, requires_all = ["n", "k"])]
    m: Option<usize>,
    #[arg(long)]
    n: Option<usize>,
    #[arg(long)]
    k: Option<usize>,
    /// Write an SVG chart of the ladder.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Time these launch configurations of a tuned variant, each as its own row, instead of the
    /// tuned one (repeatable; matmul `wgmma`: c2g8, c1g16, ...; a `d` suffix stores C from
    /// registers instead of by TMA).
    #[arg(long = "config")]
    configs: Vec<String>,
    /// How the linear bench times ours against the peer: `interleaved` (repeat by repeat in
    /// shuffled order, one clock history for all) or `sustained` (each back to back for seconds,
    /// at the clock its own power draw holds; slower).
    #[arg(long, default_value = "interleaved")]
    timing: String,
    /// Print every column of the table (min/max, registers, shared memory, occupancy, the whole
    /// note); the default is a compact table
    #[arg(long)]
    wide: bool,
    /// matmul: the default path against cuBLAS and cuBLASLt over a grid of M × (N, K) (decode to
    /// training batches, odd and vocabulary-wide sizes), bf16 and f16; prints the geometric mean
    /// and the worst cell, and `--plot` draws the heat map. `--m/--n/--k` or `--size` replace the
    /// grid; `--variant` adds named rungs beside the default.
    #[arg(long)]
    sweep: bool,
    /// `bench all`: every family's whole bench (all its shapes, dtypes, passes and sub-benches:
    /// minutes on a GPU) instead of one representative case per family (its headline shape,
    /// every variant and the peer). Only with the op `all` (a single family always runs its
    /// whole bench) and not with --quick; explicit sizes run every section at those sizes anyway.
    #[arg(long)]
    full: bool,
    /// moe: the expert-parallel layer on N ranks (threads of this process, one per GPU, NCCL
    /// between them; CPU ranks with `--device cpu`) against the one-device layer on the same
    /// tokens, and NCCL's all-to-all at the dispatch's size.
    #[arg(long)]
    ep: Option<usize>,
}

#[derive(Args)]
struct KernelArgs {
    /// Architectures, comma-separated.
    #[arg(long, default_value = "sm_80,sm_90a", value_delimiter = ',')]
    arch: Vec<String>,
    /// ptxas to assemble with and read registers/spills from (skipped when absent).
    #[arg(long)]
    ptxas: Option<PathBuf>,
    /// Keep PTX and cubins here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Fail if any kernel spills registers.
    #[arg(long)]
    deny_spills: bool,
    /// Only modules whose label contains this text (e.g. `matmul/mma[` or `FE_EPI=1`).
    #[arg(long)]
    only: Option<String>,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn devices(spec: &str) -> Result<Vec<Device>> {
    if spec == "all" {
        let mut d = vec![Device::Cpu];
        match cuda::availability() {
            Ok(n) => d.extend((0..n.min(1)).map(Device::Cuda)),
            Err(e) => eprintln!("note: GPU variants skipped: {e}"),
        }
        return Ok(d);
    }
    let d = Device::parse(spec)?;
    if let Device::Cuda(i) = d {
        cuda::device(i)?;
    }
    Ok(vec![d])
}

fn dtypes(names: &[String]) -> Result<Vec<DType>> {
    names
        .iter()
        .map(|n| {
            DType::parse(n)
                .ok_or_else(|| Error::bad_arg("ferrite", "--dtype", "f32, f16 or bf16", n))
        })
        .collect()
}

fn families(op: &str) -> Result<Vec<&'static dyn ferrite::core::harness::OpFamily>> {
    if op == "all" {
        Ok(ops::registry())
    } else {
        Ok(vec![ops::family(op)?])
    }
}

/// Every requested variant must exist in one of the selected families.
fn validate_variants(
    fams: &[&'static dyn ferrite::core::harness::OpFamily],
    wanted: &[String],
) -> Result<()> {
    for w in wanted {
        if !fams
            .iter()
            .any(|f| f.variants().iter().any(|v| v.name == w) || f.peers().contains(&w.as_str()))
        {
            let known: Vec<String> = fams
                .iter()
                .flat_map(|f| {
                    f.variants()
                        .into_iter()
                        .map(|v| v.name)
                        .chain(f.peers())
                        .map(move |v| format!("{}/{v}", f.name()))
                })
                .collect();
            return Err(Error::bad_arg(
                "ferrite",
                "--variant",
                format!("one of {}", known.join(", ")),
                w,
            ));
        }
    }
    Ok(())
}

fn spinner() -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(ProgressStyle::with_template("{spinner} [{elapsed}] {msg}").unwrap());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Before a run over several families on a GPU: every kernel module they list compiled on all
/// cores into the disk cache (`ops::warm_kernel_cache`), once per architecture among `devices`,
/// instead of one module at a time as each rung first runs. Not when `--variant` names a few
/// rungs (most modules would go unused). Says what it did above the bar.
fn warm_kernels(
    fams: &[&'static dyn ferrite::core::harness::OpFamily],
    devices: &[Device],
    variants: &[String],
    pb: &ProgressBar,
) -> Result<()> {
    if fams.len() < 2 || !variants.is_empty() {
        return Ok(());
    }
    let mut archs = Vec::new();
    for &d in devices {
        if let Some(arch) = cuda::arch_of(d)? {
            if !archs.contains(&arch) {
                archs.push(arch);
            }
        }
    }
    for arch in archs {
        let t = std::time::Instant::now();
        let w = ops::warm_kernel_cache(fams, arch, &|done, total| {
            pb.set_message(format!(
                "compiling kernels for {}: {done}/{total}",
                arch.target()
            ))
        });
        if w.compiled > 0 || w.failed > 0 {
            pb.println(format!(
                "kernels for {}: {} compiled on all cores in {:.0} s, {} from the cache{}",
                arch.target(),
                w.compiled,
                t.elapsed().as_secs_f64(),
                w.cached,
                if w.failed > 0 {
                    format!(
                        ", {} failed (reported by the rungs that launch them)",
                        w.failed
                    )
                } else {
                    String::new()
                }
            ));
        }
    }
    Ok(())
}

fn write_json(path: &PathBuf, value: &serde_json::Value) -> Result<()> {
    let s = serde_json::to_string_pretty(value).map_err(|e| Error::Other(e.to_string()))?;
    std::fs::write(path, s).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn info() -> Result<()> {
    println!("ferrite {}", env!("CARGO_PKG_VERSION"));
    let (isa, lanes) = ops::cpu_simd();
    println!(
        "cpu: {} — {} threads, {isa} ({lanes} f32 lanes)",
        ferrite::core::harness::cpu_name(),
        rayon_threads()
    );
    match cuda::availability() {
        Ok(n) => {
            for i in 0..n {
                let d = cuda::device(i)?;
                let p = d.props();
                println!(
                    "cuda:{i}: {} — {} SMs, {:.0} MiB L2, {:.1} GiB, target {}",
                    p.name,
                    p.sm_count,
                    p.l2_bytes as f64 / (1 << 20) as f64,
                    p.total_mem as f64 / (1u64 << 30) as f64,
                    p.target
                );
            }
        }
        Err(e) => println!("cuda: unavailable — {e}; CPU variants only"),
    }
    match jit::nvrtc_version() {
        Ok((a, b)) => println!(
            "nvrtc: {a}.{b}; CUDA headers: {:?}",
            jit::cuda_include_dirs()
        ),
        Err(e) => println!("nvrtc: {e}"),
    }
    println!("kernel cache: {}", jit::cache_dir().display());
    let mut t = Table::new(&[
        "op",
        "variant",
        "backend",
        "dtypes",
        "min arch",
        "what it changes",
    ]);
    for f in ops::registry() {
        for v in f.variants() {
            t.row(vec![
                f.name().into(),
                v.name.into(),
                format!("{:?}", v.backend).to_lowercase(),
                v.dtypes
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(","),
                v.min_arch
                    .map(|a| a.target().to_string())
                    .unwrap_or_else(|| "-".into()),
                v.summary.into(),
            ]);
        }
    }
    print!("\n{}", t.render());
    println!("\nwith no variant named:");
    for f in ops::registry() {
        if let Some(rule) = f.default_rule() {
            // Wrapped at 100 columns, continuation lines indented.
            let mut line = format!("  {}:", f.name());
            for word in rule.split_whitespace() {
                if line.chars().count() + 1 + word.chars().count() > 100 {
                    println!("{line}");
                    line = "    ".into();
                }
                line.push(' ');
                line.push_str(word);
            }
            println!("{line}");
        }
    }
    println!(
        "  other ops: the highest-ranked variant that takes the request (rows are listed by rank)"
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn check(a: CheckArgs) -> Result<bool> {
    let cfg = CheckConfig {
        devices: devices(&a.common.device)?,
        variants: a.common.variants.clone(),
        dtypes: dtypes(&a.common.dtypes)?,
        seed: a.seed.unwrap_or_else(Rng::fresh_seed),
        quick: a.common.quick,
    };
    let fams = families(&a.common.op)?;
    validate_variants(&fams, &cfg.variants)?;
    if let Some(p) = &a.common.json {
        check_output_path("--json", p)?;
    }
    if a.trace {
        ferrite::core::harness::check::trace_records();
    }
    let mut recs = Vec::new();
    let pb = if a.trace {
        ProgressBar::hidden()
    } else {
        spinner()
    };
    warm_kernels(&fams, &cfg.devices, &cfg.variants, &pb)?;
    for f in fams {
        pb.set_message(format!("checking {}", f.name()));
        f.check(&cfg, &mut recs)?;
    }
    pb.finish_and_clear();
    print!("{}", check_table(&recs));
    if recs.is_empty() {
        return Err(Error::Other(
            "no check case matched the given op, device, variant and dtype".into(),
        ));
    }
    let failed = recs.iter().filter(|r| !r.pass).count();
    println!(
        "\nseed {}: {} cases, {} passed, {} failed",
        cfg.seed,
        recs.len(),
        recs.len() - failed,
        failed
    );
    if let Some(p) = &a.common.json {
        write_json(p, &serde_json::json!({ "seed": cfg.seed, "records": recs }))?;
    }
    Ok(failed == 0)
}

/// An output file's folder must exist (and the path must not be a folder) before a run starts,
/// not after it has spent its minutes.
fn check_output_path(flag: &str, p: &std::path::Path) -> Result<()> {
    if p.is_dir() {
        return Err(Error::bad_arg(
            "ferrite",
            flag,
            "a file path",
            format!("{} (a folder)", p.display()),
        ));
    }
    let parent = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        return Err(Error::bad_arg(
            "ferrite",
            flag,
            "a path in an existing folder",
            format!("{} (no folder {})", p.display(), parent.display()),
        ));
    }
    Ok(())
}

/// `bench moe --ep N`: the expert-parallel layer's table (and JSON).
fn bench_ep(a: &BenchArgs, n: usize) -> Result<()> {
    if a.common.op != "moe" {
        return Err(Error::bad_arg("ferrite", "--ep", "op `moe`", &a.common.op));
    }
    // The expert-parallel bench runs its own shapes, bf16 on GPUs (f32 on CPU ranks), the best
    // variant: flags it would ignore are refused.
    for (flag, set) in [
        ("--variant", !a.common.variants.is_empty()),
        ("--dtype", !a.common.dtypes.is_empty()),
        ("--size/--m", !a.size.is_empty() || a.m.is_some()),
        ("--config", !a.configs.is_empty()),
        ("--sweep", a.sweep),
        ("--plot", a.plot.is_some()),
    ] {
        if set {
            return Err(Error::bad_arg(
                "ferrite",
                flag,
                "not with --ep (the expert-parallel bench runs its own shapes and the best variant)",
                "given",
            ));
        }
    }
    let gpu = match a.common.device.as_str() {
        "cpu" => false,
        "cuda" | "all" => ferrite::core::cuda::availability().unwrap_or(0) > 0,
        other => {
            return Err(Error::bad_arg(
                "ferrite",
                "--device",
                "cpu, cuda or all with --ep (ranks take cuda:0..N)",
                other,
            ))
        }
    };
    if let Some(p) = &a.common.json {
        check_output_path("--json", p)?;
    }
    let recs = ferrite::ops::moe::ep::bench::run(n, gpu, a.common.quick)?;
    println!(
        "{:<18} {:<30} {:>5} {:>9} {:>12} {:>12} {:>8} {:>9} {:>9} {:>10}",
        "layer",
        "shape",
        "ranks",
        "ep fwd",
        "ep fwd+bwd",
        "1 dev f+b",
        "speedup",
        "a2a ms",
        "a2a GB/s",
        "a2a/seg ms"
    );
    for r in &recs {
        println!(
            "{:<18} {:<30} {:>5} {:>9.3} {:>12.3} {:>12.3} {:>7.2}× {:>9.3} {:>9.1} {:>10.3}",
            r.shape,
            r.label,
            r.world,
            r.ep_fwd_ms,
            r.ep_fwd_bwd_ms,
            r.one_device_fwd_bwd_ms,
            r.speedup,
            r.all_to_all_ms,
            r.all_to_all_gbps,
            r.all_to_all_per_segment_ms
        );
    }
    for r in &recs {
        for (rank, ph) in r.phases.iter().enumerate() {
            let cells: Vec<String> = ph.iter().map(|(n, t)| format!("{n} {t:.2}")).collect();
            println!(
                "{} rank {rank} phases (ms, each waited for): {}",
                r.shape,
                cells.join(" · ")
            );
        }
    }
    if let Some(d) = recs.first() {
        println!("device: {} ({}), times in ms (medians)", d.device, d.dtype);
    }
    if let Some(p) = &a.common.json {
        write_json(p, &serde_json::json!({ "expert_parallel": recs }))?;
        println!("json: {}", p.display());
    }
    Ok(())
}

/// The bench flags' values, checked before anything runs: sizes positive, `--size` only for
/// families that read it, `--config` only with a GPU, output folders present.
fn validate_bench_args(
    a: &BenchArgs,
    fams: &[&'static dyn ferrite::core::harness::OpFamily],
    devices: &[Device],
) -> Result<()> {
    for (flag, v) in a.size.iter().map(|&s| ("--size", s)).chain(
        [("--m", a.m), ("--n", a.n), ("--k", a.k)]
            .into_iter()
            .filter_map(|(f, v)| v.map(|v| (f, v))),
    ) {
        if v == 0 {
            return Err(Error::bad_arg("ferrite", flag, "a positive size", v));
        }
    }
    if !a.size.is_empty() || a.m.is_some() {
        let fixed: Vec<&str> = fams
            .iter()
            .filter(|f| !f.bench_takes_size())
            .map(|f| f.name())
            .collect();
        if !fixed.is_empty() && a.common.op != "all" {
            return Err(Error::bad_arg(
                "ferrite",
                if a.size.is_empty() { "--m" } else { "--size" },
                format!(
                    "no size flag: the `{}` bench runs its own fixed shapes",
                    fixed.join("`, `")
                ),
                a.size.first().copied().or(a.m).unwrap_or(0),
            ));
        }
        if !fixed.is_empty() {
            eprintln!(
                "note: the size flags do not apply to {} (fixed shapes)",
                fixed.join(", ")
            );
        }
    }
    if !a.configs.is_empty() && !devices.iter().any(|d| d.is_cuda()) {
        return Err(Error::bad_arg(
            "ferrite",
            "--config",
            "a CUDA device among --device (launch configurations are GPU kernels')",
            a.common.device.as_str(),
        ));
    }
    if a.full && a.common.op != "all" {
        return Err(Error::bad_arg(
            "ferrite",
            "--full",
            "the op `all` (a single family's bench always runs in full)",
            a.common.op.as_str(),
        ));
    }
    if a.full && a.common.quick {
        return Err(Error::bad_arg(
            "ferrite",
            "--full",
            "not with --quick (every family's smaller cases)",
            "--quick",
        ));
    }
    if a.sweep {
        if a.common.op != "matmul" {
            return Err(Error::bad_arg(
                "ferrite",
                "--sweep",
                "the op `matmul` (the sweep is matmul's)",
                a.common.op.as_str(),
            ));
        }
        if !devices.iter().any(|d| d.is_cuda()) {
            return Err(Error::bad_arg(
                "ferrite",
                "--sweep",
                "a CUDA device among --device (the sweep compares the GPU default with cuBLAS)",
                a.common.device.as_str(),
            ));
        }
    }
    if let Some(p) = &a.common.json {
        check_output_path("--json", p)?;
    }
    if let Some(p) = &a.plot {
        check_output_path("--plot", p)?;
    }
    Ok(())
}

/// The problem shapes given on the command line: each `--size`, and `--m --n --k`.
fn bench_shapes(a: &BenchArgs) -> Vec<Vec<usize>> {
    let mut shapes: Vec<Vec<usize>> = a.size.iter().map(|&s| vec![s]).collect();
    if let (Some(m), Some(n), Some(k)) = (a.m, a.n, a.k) {
        shapes.push(vec![m, n, k]);
    }
    shapes
}

/// Whether the bench runs one representative case per family: `bench all` as it comes. `--full`
/// asks for every family's whole bench; `--quick` and explicit sizes keep their own meaning (every
/// family's smaller cases, or every section at the sizes given).
fn representative_scope(a: &BenchArgs, shapes: &[Vec<usize>]) -> bool {
    a.common.op == "all" && !a.full && !a.common.quick && shapes.is_empty()
}

/// The bench's progress on stderr: with several families a bar over them (position: families
/// done), else a spinner; the message names the family and the case being timed.
fn bench_progress(families: usize) -> ProgressBar {
    if families < 2 {
        return spinner();
    }
    let pb = ProgressBar::new(families as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed}] {bar:20} {pos}/{len} families  {wide_msg}",
        )
        .unwrap(),
    );
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Whether a bench record times one of its family's variants (not a peer, nor a row the bench
/// adds beside the ladder): the rows the summary picks the best from.
fn is_ladder_row(r: &ferrite::core::harness::BenchRecord) -> bool {
    ops::family(&r.op).is_ok_and(|f| f.variants().iter().any(|v| v.name == r.variant))
}

fn bench(a: BenchArgs) -> Result<()> {
    if let Some(n) = a.ep {
        return bench_ep(&a, n);
    }
    let shapes = bench_shapes(&a);
    let representative = representative_scope(&a, &shapes);
    let cfg = BenchConfig {
        devices: devices(&a.common.device)?,
        variants: a.common.variants.clone(),
        dtypes: dtypes(&a.common.dtypes)?,
        shapes,
        quick: a.common.quick,
        configs: a.configs.clone(),
        timing: a.timing.parse::<Timing>()?,
        sweep: a.sweep,
        representative,
    };
    let fams = families(&a.common.op)?;
    validate_variants(&fams, &cfg.variants)?;
    validate_bench_args(&a, &fams, &cfg.devices)?;
    let pb = bench_progress(fams.len());
    warm_kernels(&fams, &cfg.devices, &cfg.variants, &pb)?;
    let mut progress = |m: &str| pb.set_message(m.to_string());
    let ceilings = ops::measure_ceilings(&cfg.devices, cfg.quick, &mut progress)?;
    let mut recs = Vec::new();
    for f in fams {
        progress(f.name());
        f.bench(&cfg, &ceilings, &mut progress, &mut recs)?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    if recs.is_empty() {
        return Err(Error::Other(format!(
            "no bench record matched op `{}`, device `{}`, variants {:?} and dtypes {:?} (e.g. a dtype the device's variants do not run)",
            a.common.op, a.common.device, cfg.variants, a.common.dtypes
        )));
    }
    println!("ceilings measured in this run:");
    if let (Some(ghz), Some(peak)) = (ceilings.cpu_ghz, ceilings.cpu_core_peak_gflops) {
        println!("  cpu: {ghz:.2} GHz (measured), {}, nominal peak {peak:.0} GFLOP/s per core; {} threads", ceilings.cpu_isa, ceilings.cpu_threads);
    }
    if let Some(p) = ceilings.cpu_peer_gflops {
        println!("  cpu: gemm crate f32 {p:.1} GFLOP/s (all threads)");
    }
    if let Some(bw) = ceilings.gpu_copy_gbps {
        println!("  gpu: device copy {bw:.0} GB/s (read + write)");
    }
    for (d, v) in &ceilings.gpu_gemm_gflops {
        println!("  gpu: cuBLAS {d} {:.1} TFLOP/s", v / 1e3);
    }
    println!();
    print!("{}", bench_table(&recs, a.wide));
    if recs
        .iter()
        .map(|r| (&r.device, &r.op))
        .collect::<std::collections::HashSet<_>>()
        .len()
        > 1
    {
        println!(
            "\nsummary: each family's largest case, its fastest variant, the peer where it has one"
        );
        if representative {
            println!(
                "(one representative case per family; `--full` runs every family's whole bench)"
            );
        }
        print!("{}", bench_summary(&recs, &is_ladder_row));
    }
    if a.sweep {
        println!("\nsweep: the default path against the faster vendor library, per cell");
        print!("{}", sweep_summary(&recs, DEFAULT_ROW));
    }
    if let Some(p) = &a.common.json {
        write_json(
            p,
            &serde_json::json!({ "ceilings": ceilings, "records": recs }),
        )?;
        println!("json: {}", p.display());
    }
    if let Some(p) = &a.plot {
        let title = format!(
            "ferrite bench {} — {}",
            a.common.op,
            recs.first().map(|r| r.device.clone()).unwrap_or_default()
        );
        let svg = if a.sweep {
            sweep_svg(&recs, DEFAULT_ROW, &title)
        } else {
            ladder_svg(&recs, &title)
        };
        std::fs::write(p, svg).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
        println!("chart: {}", p.display());
    }
    Ok(())
}

fn kernels(a: KernelArgs) -> Result<bool> {
    let archs: Vec<Arch> = a
        .arch
        .iter()
        .map(|s| Arch::parse_target(s))
        .collect::<Result<_>>()?;
    if let Some(p) = &a.ptxas {
        if !p.exists() {
            return Err(Error::bad_arg(
                "kernels",
                "--ptxas",
                "a path to ptxas",
                p.display(),
            ));
        }
    }
    let builds = ops::build_kernels(
        &archs,
        a.ptxas.as_deref(),
        a.out.as_deref(),
        a.only.as_deref(),
    )?;
    let mut t = Table::new(&[
        "module", "function", "arch", "regs", "smem", "stack", "spill st", "spill ld", "cached",
    ]);
    let o = |v: Option<u32>| v.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
    for b in &builds {
        t.row(vec![
            b.module.clone(),
            b.function.clone(),
            b.arch.clone(),
            o(b.registers),
            o(b.smem_bytes),
            o(b.stack_bytes),
            o(b.spill_stores),
            o(b.spill_loads),
            b.from_cache.to_string(),
        ]);
    }
    print!("{}", t.render());
    let spilling: Vec<_> = builds
        .iter()
        .filter(|b| b.spill_stores.unwrap_or(0) > 0 || b.spill_loads.unwrap_or(0) > 0)
        .collect();
    println!(
        "\n{} kernels compiled for {}; {} spill",
        builds.len(),
        a.arch.join(", "),
        spilling.len()
    );
    if let Some(p) = &a.json {
        write_json(p, &serde_json::json!({ "kernels": builds }))?;
    }
    Ok(!a.deny_spills || spilling.is_empty())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Info => info().map(|_| true),
        Cmd::Check(a) => check(a),
        Cmd::Bench(a) => bench(a).map(|_| true),
        Cmd::Kernels(a) => kernels(a),
        Cmd::Data(c) => data_cmd::run(c),
        Cmd::Train(a) => train_cmd::run(*a),
        Cmd::Sample(a) => train_cmd::sample(a),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Which `bench` command lines run one representative case per family.
#[cfg(test)]
mod bench_scope {
    use super::*;

    fn scope(args: &[&str]) -> bool {
        let argv = ["ferrite", "bench"].iter().chain(args);
        let Cmd::Bench(a) = Cli::try_parse_from(argv).expect("parses").cmd else {
            panic!("not a bench command");
        };
        representative_scope(&a, &bench_shapes(&a))
    }

    #[test]
    fn representative_is_bench_all_as_it_comes() {
        assert!(scope(&[]));
        assert!(scope(&["all", "--device", "cpu", "--dtype", "f32"]));
        assert!(!scope(&["all", "--full"]));
        assert!(!scope(&["all", "--quick"]));
        assert!(!scope(&["all", "--size", "512"]));
        assert!(!scope(&["all", "--m", "8", "--n", "8", "--k", "8"]));
        assert!(!scope(&["matmul"]));
    }
}

/// Property test of the argument parsing and the checks made before a run: any mix of known
/// subcommands, flags and values parses to an error or to arguments whose checks end in a value
/// or an error — never a panic. (Nothing runs: only `Cli::try_parse_from` and the checks.)
#[cfg(test)]
mod arg_fuzz {
    use super::*;
    use clap::Parser;
    use proptest::prelude::*;

    fn token() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "check",
                "bench",
                "kernels",
                "info",
                "data",
                "train",
                "sample",
                "all",
                "matmul",
                "softmax",
                "copy",
                "decode",
                "moe",
                "rotary",
                "--size",
                "--m",
                "--n",
                "--k",
                "--device",
                "--dtype",
                "--variant",
                "--config",
                "--json",
                "--plot",
                "--quick",
                "--timing",
                "--full",
                "--seed",
                "--arch",
                "cpu",
                "cuda",
                "cuda:7",
                "f16",
                "bf16",
                "f99",
                "0",
                "1",
                "64",
                "-3",
                "18446744073709551615",
                "99999999999999999999",
                "nan",
                "/nonexistent/x.json",
                "/tmp",
                "interleaved",
                "sustained",
                "c2g8",
                "sm_80",
            ])
            .prop_map(str::to_string),
            ".{0,12}",
        ]
    }

    proptest! {
        #[test]
        fn arguments_parse_and_check_without_panicking(
            cmd in prop::sample::select(vec!["check", "bench", "kernels"]),
            args in prop::collection::vec(token(), 0..8),
        ) {
            let argv = ["ferrite".to_string(), cmd.to_string()].into_iter().chain(args);
            if let Ok(cli) = Cli::try_parse_from(argv) {
                match cli.cmd {
                    Cmd::Bench(a) => {
                        if let (Ok(fams), Ok(devs)) = (families(&a.common.op), devices(&a.common.device)) {
                            let _ = validate_variants(&fams, &a.common.variants);
                            let _ = validate_bench_args(&a, &fams, &devs);
                            let _ = dtypes(&a.common.dtypes);
                            let _ = a.timing.parse::<Timing>();
                        }
                    }
                    Cmd::Check(a) => {
                        if let Ok(fams) = families(&a.common.op) {
                            let _ = validate_variants(&fams, &a.common.variants);
                        }
                        let _ = devices(&a.common.device);
                        let _ = dtypes(&a.common.dtypes);
                    }
                    Cmd::Kernels(a) => {
                        let _ = a.arch.iter().map(|s| Arch::parse_target(s)).collect::<Result<Vec<_>>>();
                    }
                    _ => {}
                }
            }
        }
    }
}
