//! `ferrite train`: a GPT from token shards, a progress line per step, a JSON log and a loss curve.

use clap::Args;
use ferrite::core::cuda;
use ferrite::core::harness::Precision;
use ferrite::train::{self, ModelConfig, Schedule, StepLog, TrainConfig};
use ferrite::{DType, Device, Error, Result};
use std::path::PathBuf;

#[derive(Args)]
pub struct TrainArgs {
    /// Training shards: a folder with index.json (from `ferrite data pack`) or one shard file.
    #[arg(long)]
    data: PathBuf,
    /// Validation shards.
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// gpt2-124m, gpt2-350m, gpt2-774m or gpt2-tiny.
    #[arg(long, default_value = "gpt2-124m")]
    model: String,
    /// cpu, cuda or cuda:N (default: cuda:0 when a GPU is usable, else cpu).
    #[arg(long)]
    device: Option<String>,
    /// Sequences per micro-batch.
    #[arg(long, short = 'b', default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, short = 't', default_value_t = 1024)]
    seq: usize,
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// The final learning rate as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    min_lr_frac: f64,
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// cosine, wsd or constant.
    #[arg(long, default_value = "cosine")]
    schedule: String,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Evaluate on --val-data every N steps (0: never).
    #[arg(long, default_value_t = 0)]
    val_every: usize,
    /// Batches per evaluation (default 8).
    #[arg(long)]
    val_batches: Option<usize>,
    /// Attention backward without atomics: the same bits every run.
    #[arg(long)]
    deterministic: bool,
    /// Skip (and log) updates whose loss or gradient is not finite instead of stopping.
    #[arg(long)]
    skip_nonfinite: bool,
    /// Dense bf16 peak (TFLOP/s) for MFU (default: the device's measured cuBLAS bf16 rate, or 1
    /// on the CPU).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Write the run (settings, every step, summary) as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the loss curve as SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Save checkpoints (safetensors: Hugging Face GPT-2 weights + the exact training state) under
    /// DIR/step-NNNNNN, every --save-every steps and after the last.
    #[arg(long)]
    save: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Continue from a checkpoint folder (DIR/step-NNNNNN): weights, AdamW state, step, data position.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from Hugging Face GPT-2 weights (a folder with model.safetensors, or the file).
    #[arg(long)]
    init_hf: Option<PathBuf>,
    /// Recompute the norms' outputs and the MLP activation in the backward instead of keeping
    /// them per layer (less memory, a little more time).
    #[arg(long)]
    recompute: bool,
    /// Append every batch's token rows (i32 [B, T+1]) to FILE: a peer can train on the same batches.
    #[arg(long)]
    dump_batches: Option<PathBuf>,
    /// Run every op from the host each step (no CUDA-graph replay): for debugging.
    #[arg(long)]
    no_graph: bool,
    /// Profile this step (1-based): GPU and host time per op, printed after the run.
    #[arg(long)]
    profile_step: Option<usize>,
    /// Print one line every N steps (the first and last always).
    #[arg(long, default_value_t = 1)]
    print_every: usize,
    /// Data-parallel training over N processes on this machine, one per GPU (or N CPU
    /// workers): B sequences per process and step, gradients summed over the processes (NCCL on
    /// the GPU). Any launcher that sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT) works too, without this flag.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// With several processes: ZeRO-1 — each keeps 1/N of the f32 master weights and AdamW
    /// moments (gradients reduce-scattered, weights all-gathered after the update).
    #[arg(long)]
    zero: bool,
    /// With several GPUs: all-reduce the gradients after the backward instead of each layer's
    /// while the backward goes on (for comparison and debugging).
    #[arg(long)]
    no_overlap: bool,
}

/// `--nproc N`: starts N copies of this command as ranks 0..N (torchrun's variables, a free
/// port on 127.0.0.1) and waits for them; the first rank to fail stops the others, and the error
/// names it.
fn launch(n: usize, device: Option<&str>) -> Result<bool> {
    let wants_gpu = !matches!(device, Some("cpu"));
    if wants_gpu {
        if let Some(d) = device.filter(|d| *d != "cuda") {
            return Err(Error::bad_arg(
                "train",
                "--device",
                "cuda or cpu with --nproc (rank r takes cuda:r)",
                d,
            ));
        }
        let gpus = cuda::availability().unwrap_or(0);
        if gpus > 0 && gpus < n {
            return Err(Error::bad_arg(
                "train",
                "--nproc",
                format!("at most the {gpus} visible GPUs (one process per GPU)"),
                n,
            ));
        }
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this executable", e))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("picking a free port for the ranks' rendezvous", e))?
        .port();
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut kids = Vec::with_capacity(n);
    for r in 0..n {
        let child = std::process::Command::new(&exe)
            .args(&args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn()
            .map_err(|e| Error::io(format!("starting rank {r}"), e))?;
        kids.push(Some(child));
    }
    let mut failed: Option<String> = None;
    while kids.iter().any(Option::is_some) {
        for (r, k) in kids.iter_mut().enumerate() {
            let Some(c) = k else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *k = None;
                    if !st.success() && failed.is_none() {
                        failed = Some(format!("rank {r} exited with {st}"));
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(Error::io(format!("waiting for rank {r}"), e)),
            }
        }
        if failed.is_some() {
            // A rank that failed leaves the others waiting on it (in NCCL, which has no timeout).
            for c in kids.iter_mut().flatten() {
                let _ = c.kill();
                let _ = c.wait();
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    match failed {
        Some(f) => Err(Error::Other(format!(
            "train --nproc {n}: {f}; the other ranks were stopped"
        ))),
        None => Ok(true),
    }
}

fn device_of(spec: Option<&str>) -> Result<Device> {
    match spec {
        Some(s) => {
            let d = Device::parse(s)?;
            if let Device::Cuda(i) = d {
                cuda::device(i)?;
            }
            Ok(d)
        }
        None => Ok(match cuda::availability() {
            Ok(n) if n > 0 => Device::Cuda(0),
            Ok(_) => Device::Cpu,
            Err(e) => {
                eprintln!("note: training on the CPU: {e}");
                Device::Cpu
            }
        }),
    }
}

/// The bf16 GEMM rate measured on this GPU (cuBLAS, 4096³), for MFU.
fn measured_peak(device: Device) -> Result<f64> {
    match device {
        Device::Cpu => Ok(1.0),
        Device::Cuda(i) => {
            eprintln!("measuring the bf16 GEMM peak (cuBLAS 4096³) for MFU …");
            Ok(ferrite::ops::cublas_gflops(i, DType::BF16, Precision::Bf16, 4096)? / 1e3)
        }
    }
}

fn line(l: &StepLog, steps: usize) -> String {
    let mut s = format!(
        "step {:>5}/{steps} | loss {:.4} | lr {:.2e} | norm {:.3} | {:.1} ms (host {:.1}) | {:.0} tok/s | MFU {:.1}% | data wait {:.2}%",
        l.step + 1,
        l.loss,
        l.lr,
        l.grad_norm,
        l.ms,
        l.host_ms,
        l.tokens_per_s,
        l.mfu * 100.0,
        l.data_wait * 100.0
    );
    if l.mem_gib > 0.0 {
        s.push_str(&format!(" | {:.2} GiB", l.mem_gib));
    }
    if let Some(v) = l.val_loss {
        s.push_str(&format!(" | val {v:.4}"));
    }
    if l.skipped {
        s.push_str(" | update skipped (non-finite)");
    }
    s
}

/// A loss-curve SVG (train loss per step, validation points).
fn loss_svg(log: &[StepLog], title: &str) -> String {
    let (w, h, pad) = (720.0, 360.0, 48.0);
    let finite: Vec<f64> = log
        .iter()
        .map(|l| l.loss)
        .filter(|x| x.is_finite())
        .collect();
    let lo = finite.iter().cloned().fold(f64::INFINITY, f64::min).min(
        log.iter()
            .filter_map(|l| l.val_loss)
            .fold(f64::INFINITY, f64::min),
    );
    let hi = finite.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    let n = log.len().max(2) as f64 - 1.0;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / n;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * (v - lo) / (hi - lo);
    let pts: Vec<String> = log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.loss.is_finite())
        .map(|(i, l)| format!("{:.1},{:.1}", x(i), y(l.loss)))
        .collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
         <text x=\"{pad}\" y=\"24\" font-size=\"14\">{title}</text>\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"#444\"/>\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"#444\"/>\
         <text x=\"4\" y=\"{yt:.1}\">{hi:.2}</text><text x=\"4\" y=\"{yb:.1}\">{lo:.2}</text>\
         <text x=\"{r}\" y=\"{xl}\" text-anchor=\"end\">step {steps}</text>\
         <polyline fill=\"none\" stroke=\"#c0392b\" stroke-width=\"1.5\" points=\"{p}\"/>",
        b = h - pad,
        r = w - pad,
        yt = pad + 4.0,
        yb = h - pad,
        xl = h - pad + 18.0,
        steps = log.len(),
        p = pts.join(" ")
    );
    for (i, l) in log.iter().enumerate() {
        if let Some(v) = l.val_loss {
            s.push_str(&format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#2c3e50\"/>",
                x(i),
                y(v)
            ));
        }
    }
    s.push_str("<text x=\"560\" y=\"44\" fill=\"#c0392b\">train loss</text><text x=\"560\" y=\"60\" fill=\"#2c3e50\">● validation</text></svg>\n");
    s
}

const DEFAULT_VAL_BATCHES: usize = 8;

/// Flags that only mean something beside another one, and 1-based or positive counts, checked
/// before any work: a flag the run would not read is refused, not ignored. (`TrainConfig`
/// checks the training numbers themselves.)
fn check_flags(a: &TrainArgs) -> Result<()> {
    let needs =
        |flag: &str, what: &str, given: String| Err(Error::bad_arg("train", flag, what, given));
    if a.val_data.is_some() && a.val_every == 0 {
        return needs(
            "--val-data",
            "--val-every N ≥ 1 (how often to evaluate on it)",
            "no --val-every".into(),
        );
    }
    if a.val_data.is_none() && a.val_every > 0 {
        return needs(
            "--val-every",
            "--val-data (the shards to evaluate on)",
            a.val_every.to_string(),
        );
    }
    match a.val_batches {
        Some(0) => return needs("--val-batches", "≥ 1", "0".into()),
        Some(n) if a.val_data.is_none() => {
            return needs(
                "--val-batches",
                "--val-data (the shards to evaluate on)",
                n.to_string(),
            )
        }
        _ => {}
    }
    if a.save_every > 0 && a.save.is_none() {
        return needs(
            "--save-every",
            "--save DIR (where checkpoints go)",
            a.save_every.to_string(),
        );
    }
    if let Some(p) = a.profile_step {
        if p == 0 || p > a.steps {
            return needs(
                "--profile-step",
                &format!("a step in 1..={} (1-based, at most --steps)", a.steps),
                p.to_string(),
            );
        }
    }
    if a.print_every == 0 {
        return needs("--print-every", "≥ 1", "0".into());
    }
    for (flag, path) in [("--json", &a.json), ("--svg", &a.svg)] {
        if let Some(p) = path {
            crate::check_output_path(flag, p)?;
        }
    }
    Ok(())
}

pub fn run(a: TrainArgs) -> Result<bool> {
    if a.nproc == 0 {
        return Err(Error::bad_arg("train", "--nproc", "≥ 1", 0));
    }
    check_flags(&a)?;
    let dist = ferrite::dist::DistEnv::from_env()?;
    if dist.is_none() && a.nproc > 1 {
        return launch(a.nproc, a.device.as_deref());
    }
    if let Some(d) = &dist {
        if a.nproc > 1 && a.nproc != d.world {
            return Err(Error::bad_arg(
                "train",
                "--nproc",
                format!("WORLD_SIZE ({}) under a launcher", d.world),
                a.nproc,
            ));
        }
    }
    let device = match &dist {
        // Rank r trains on cuda:LOCAL_RANK.
        Some(d) => match a.device.as_deref() {
            Some("cpu") => Device::Cpu,
            None | Some("cuda") => match device_of(None)? {
                Device::Cpu if a.device.is_none() => Device::Cpu,
                _ => device_of(Some(&format!("cuda:{}", d.local_rank)))?,
            },
            Some(other) => {
                return Err(Error::bad_arg(
                    "train",
                    "--device",
                    "cuda or cpu when several processes train (rank r takes cuda:LOCAL_RANK)",
                    other,
                ))
            }
        },
        None => device_of(a.device.as_deref())?,
    };
    let lead = dist.as_ref().is_none_or(|d| d.rank == 0);
    for (flag, set) in [("--zero", a.zero), ("--no-overlap", a.no_overlap)] {
        if set && dist.is_none() {
            return Err(Error::bad_arg(
                "train",
                flag,
                "several processes (--nproc N with N ≥ 2, or a launcher's WORLD_SIZE ≥ 2)",
                "one process",
            ));
        }
    }
    if a.no_graph && !device.is_cuda() {
        return Err(Error::bad_arg(
            "train",
            "--no-graph",
            "a CUDA device (only the GPU step replays a CUDA graph)",
            device.to_string(),
        ));
    }
    let model = ModelConfig::preset(&a.model)?;
    let dtype = if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let cfg = TrainConfig {
        batch: a.batch,
        seq: a.seq,
        grad_accum: a.grad_accum,
        steps: a.steps,
        lr: a.lr,
        min_lr_frac: a.min_lr_frac,
        warmup: a.warmup,
        schedule: Schedule::parse(&a.schedule)?,
        weight_decay: a.weight_decay,
        clip: a.clip,
        seed: a.seed,
        val_every: a.val_every,
        val_batches: a.val_batches.unwrap_or(DEFAULT_VAL_BATCHES),
        skip_nonfinite: a.skip_nonfinite,
        ..Default::default()
    };
    let peak = match a.peak_tflops {
        Some(p) if p.is_finite() && p > 0.0 => p,
        Some(p) => return Err(Error::bad_arg("train", "--peak-tflops", "a number > 0", p)),
        None => measured_peak(device)?,
    };
    let o = train::RunOptions {
        data: a.data.clone(),
        val_data: a.val_data.clone(),
        device,
        dtype,
        model: model.clone(),
        train: cfg.clone(),
        deterministic: a.deterministic,
        peak_tflops: peak,
        profile_step: a.profile_step.map(|s| s.saturating_sub(1)),
        graph: !a.no_graph,
        save: a.save.clone(),
        save_every: a.save_every,
        resume: a.resume.clone(),
        init_hf: a.init_hf.clone(),
        recompute: a.recompute,
        dump_batches: a.dump_batches.clone(),
        zero: a.zero,
        overlap: !a.no_overlap,
    };
    let world = dist.as_ref().map_or(1, |d| d.world);
    if lead {
        eprintln!(
            "training {} ({:.1} M parameters) on {}{device} in {dtype}: B {} × T {} × accumulation {}{} = {} tokens per step, {} steps",
            model.name,
            model.num_params() as f64 / 1e6,
            if world > 1 {
                format!("{world} ranks{}, rank 0 on ", if a.zero { " (ZeRO-1)" } else { "" })
            } else {
                String::new()
            },
            cfg.batch,
            cfg.seq,
            cfg.grad_accum,
            if world > 1 { format!(" × {world} ranks") } else { String::new() },
            cfg.batch * cfg.seq * cfg.grad_accum * world,
            cfg.steps
        );
    }
    let steps = cfg.steps;
    let every = a.print_every;
    let mut on_step = |l: &StepLog| {
        if lead
            && (l.step.is_multiple_of(every)
                || l.step + 1 == steps
                || l.val_loss.is_some()
                || l.skipped)
        {
            println!("{}", line(l, steps));
        }
    };
    let s = match dist {
        Some(d) => {
            let rank = d.rank;
            let mut pg = ferrite::dist::ProcessGroup::new(d)?;
            train::run_dist(&o, &mut pg, &mut on_step)
                .map_err(|e| Error::Other(format!("rank {rank}: {e}")))?
        }
        None => train::run(&o, &mut on_step)?,
    };
    if !lead {
        return Ok(true);
    }
    println!(
        "done: {} steps{}, loss {:.4} → {:.4}{} | median {:.0} tok/s ({:.1} ms/step, host {:.2} ms{}), MFU {:.1}% of {peak:.0} TFLOP/s, data wait {:.2}%{}",
        s.steps,
        if s.world > 1 { format!(" on {} ranks", s.world) } else { String::new() },
        s.first_loss,
        s.last_loss,
        s.last_val_loss.map_or(String::new(), |v| format!(" (val {v:.4})")),
        s.tokens_per_s,
        s.step_ms,
        s.host_ms,
        if s.graph { ", CUDA graph" } else { "" },
        s.mfu * 100.0,
        s.data_wait * 100.0,
        if s.peak_gib > 0.0 { format!(", peak {:.2} GiB", s.peak_gib) } else { String::new() }
    );
    if let Some(e) = &s.graph_error {
        println!("note: the step ran op by op, not as a CUDA graph: {e}");
    }
    if !s.profile.is_empty() {
        let gpu: f64 = s.profile.iter().map(|r| r.gpu_ms).sum();
        let host: f64 = s.profile.iter().map(|r| r.host_ms).sum();
        println!(
            "profile of step {} (GPU: stream time between op marks; host: time to queue them):",
            a.profile_step.unwrap_or(0)
        );
        println!(
            "  {:<46} {:>6} {:>9} {:>7} {:>9}",
            "op", "calls", "GPU ms", "GPU %", "host ms"
        );
        let mut rows = s.profile.clone();
        if gpu > 0.0 {
            rows.sort_by(|x, y| y.gpu_ms.total_cmp(&x.gpu_ms));
        } else {
            rows.sort_by(|x, y| y.host_ms.total_cmp(&x.host_ms));
        }
        for r in &rows {
            println!(
                "  {:<46} {:>6} {:>9.3} {:>6.1}% {:>9.3}",
                r.label,
                r.calls,
                r.gpu_ms,
                100.0 * r.gpu_ms / gpu.max(1e-9),
                r.host_ms
            );
        }
        println!(
            "  {:<46} {:>6} {:>9.3} {:>7} {:>9.3}",
            "total", "", gpu, "", host
        );
    }
    if let Some(p) = &a.json {
        let v =
            serde_json::json!({ "model": model, "train": cfg, "peak_tflops": peak, "summary": s });
        std::fs::write(p, serde_json::to_string_pretty(&v).unwrap())
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    if let Some(p) = &a.svg {
        let title = format!("{} on {} — B {} T {}", s.model, s.device, s.batch, s.seq);
        std::fs::write(p, loss_svg(&s.log, &title))
            .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    Ok(true)
}

#[derive(Args)]
pub struct SampleArgs {
    /// A checkpoint folder written by `ferrite train --save` (DIR/step-NNNNNN).
    #[arg(long)]
    ckpt: PathBuf,
    /// Text to continue (GPT-2 BPE).
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// New tokens to generate.
    #[arg(long, short = 'n', default_value_t = 128)]
    tokens: usize,
    /// 0: greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the k most likely tokens (0: all; default 50).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p (default 0.95).
    #[arg(long)]
    top_p: Option<f32>,
    /// The sampler's seed (default 0).
    #[arg(long)]
    seed: Option<u64>,
    /// cpu, cuda or cuda:N (default: cuda:0 when a GPU is usable, else cpu).
    #[arg(long)]
    device: Option<String>,
}

pub fn sample(a: SampleArgs) -> Result<bool> {
    use ferrite::train::sample;
    let top_p = a.top_p.unwrap_or(0.95);
    if !(a.temperature >= 0.0 && a.temperature.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(Error::bad_arg(
            "sample",
            "--temperature/--top-p",
            "temperature ≥ 0 and top-p in (0, 1]",
            format!("{}/{}", a.temperature, top_p),
        ));
    }
    // Greedy decoding draws nothing: the sampling flags would be ignored.
    if a.temperature == 0.0 {
        let given = [
            ("--top-k", a.top_k.is_some()),
            ("--top-p", a.top_p.is_some()),
            ("--seed", a.seed.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|g| g.1) {
            return Err(Error::bad_arg(
                "sample",
                *flag,
                "no sampling flag with --temperature 0 (greedy decoding draws nothing)",
                "given",
            ));
        }
    }
    let device = device_of(a.device.as_deref())?;
    let model = sample::load(&a.ckpt, device)?;
    let bpe = ferrite::data::pack::gpt2()?;
    let prompt: Vec<u32> = bpe.encode_with_special_tokens(&a.prompt);
    let t0 = std::time::Instant::now();
    let out = sample::generate(
        &model,
        &prompt,
        a.tokens,
        &sample::SampleOptions {
            temperature: a.temperature,
            top_k: a.top_k.unwrap_or(50),
            top_p,
            seed: a.seed.unwrap_or(0),
        },
    )?;
    let secs = t0.elapsed().as_secs_f64();
    let text = bpe
        .decode(&prompt.iter().chain(&out).copied().collect::<Vec<u32>>())
        .unwrap_or_else(|_| String::from("(not valid UTF-8 as decoded)"));
    println!("{text}");
    eprintln!(
        "{} ({:.1} M parameters) on {device}: {} prompt + {} new tokens in {:.2} s ({:.0} tokens/s, KV cache in {}-token pages)",
        model.cfg.name,
        model.cfg.num_params() as f64 / 1e6,
        prompt.len(),
        out.len(),
        secs,
        (prompt.len() + out.len()) as f64 / secs,
        sample::PAGE
    );
    Ok(true)
}
