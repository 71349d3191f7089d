//! The op families, one folder each, and what runs across all of them: the registry, the machine
//! ceilings measured before a bench, and the kernel build check.
//!
//! Layers: every family builds on `crate::core` (tensors, dtypes, devices, errors, the CUDA
//! runtime and NVRTC, the harness, the shared activation functions in `core::act`). Families do
//! not reach into each other, except along the edges in [`FAMILY_DEPENDENCIES`]: `matmul` is the
//! GEMM layer that `linear` and `moe` build on (and whose cuBLASLt plan `scaled_mm` uses as its
//! FP8 peer, and whose bf16 GEMMs `w8a16`'s bench runs as its peers), and `moe`'s GLU runs the `activation` family's pass. A test reads the sources and fails on any other `crate::ops::<family>` path.

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod copy;
pub mod cross_entropy;
pub mod decode;
pub mod linear;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod rotary;
pub mod scaled_mm;
pub mod softmax;
pub mod w8a16;

use crate::core::cuda::{self, jit};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::bench::{time_gpu, Budget};
use crate::core::harness::{Ceilings, KernelSpec, OpFamily, Precision};
use crate::core::tensor::Tensor;

/// The only cross-family imports allowed, as (family, family it may use).
pub const FAMILY_DEPENDENCIES: &[(&str, &str)] = &[
    ("linear", "matmul"),
    ("moe", "matmul"),
    ("moe", "activation"),
    ("scaled_mm", "matmul"),
    ("w8a16", "matmul"),
];

/// Every op family, in the order `check all` and `bench all` run them.
pub fn registry() -> Vec<&'static dyn OpFamily> {
    vec![
        &copy::Copy,
        &matmul::Matmul,
        &linear::Linear,
        &norm::Norm,
        &softmax::Softmax,
        &rotary::Rotary,
        &activation::ActivationFamily,
        &cross_entropy::CrossEntropy,
        &adamw::AdamW,
        &attention::Attention,
        &decode::Decode,
        &moe::Moe,
        &scaled_mm::ScaledMm,
        &w8a16::W8a16,
    ]
}

/// The family called `name`, or an error listing the families.
pub fn family(name: &str) -> Result<&'static dyn OpFamily> {
    registry()
        .into_iter()
        .find(|f| f.name() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = registry().iter().map(|f| f.name()).collect();
            Error::bad_arg(
                "ferrite",
                "OP",
                format!("one of: all, {}", names.join(", ")),
                name,
            )
        })
}

/// Clock of one core in GHz, measured: a chain of dependent adds retires one per cycle.
pub fn measure_cpu_ghz() -> f64 {
    let iters: u64 = 200_000_000;
    let run = || {
        let t = std::time::Instant::now();
        let mut x: u64 = std::hint::black_box(1);
        for _ in 0..iters / 4 {
            x = std::hint::black_box(x.wrapping_add(3));
            x = std::hint::black_box(x.wrapping_add(5));
            x = std::hint::black_box(x.wrapping_add(7));
            x = std::hint::black_box(x.wrapping_add(9));
        }
        std::hint::black_box(x);
        t.elapsed().as_secs_f64()
    };
    let best = (0..3).map(|_| run()).fold(f64::MAX, f64::min);
    // black_box forces a store/load per add on some compilers; the add chain is then bound by
    // store-forwarding, not the ALU, so this is a lower bound on the clock.
    iters as f64 / best / 1e9
}

/// The widest f32 SIMD the CPU runs and its lane count.
pub fn cpu_simd() -> (&'static str, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return ("avx512f", 16);
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return ("avx2+fma", 8);
        }
        ("sse2", 4)
    }
    #[cfg(not(target_arch = "x86_64"))]
    ("portable", 4)
}

/// Measures the ceilings a bench run compares against, for the devices it will use.
pub fn measure_ceilings(
    devices: &[Device],
    quick: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Ceilings> {
    let mut c = Ceilings {
        cpu_threads: rayon::current_num_threads(),
        ..Default::default()
    };
    for &d in devices {
        match d {
            Device::Cpu => {
                progress("ceilings: cpu clock");
                let (isa, lanes) = cpu_simd();
                let ghz = measure_cpu_ghz();
                c.cpu_ghz = Some(ghz);
                c.cpu_isa = isa.into();
                // GHz × lanes × 2 flops per FMA × 2 FMA pipes.
                c.cpu_core_peak_gflops = Some(ghz * lanes as f64 * 2.0 * 2.0);
                if cfg!(feature = "bench") {
                    progress("ceilings: cpu peer gemm");
                }
                c.cpu_peer_gflops = cpu_peer_gflops(quick)?;
            }
            Device::Cuda(i) => {
                let dev = cuda::device(i)?;
                progress("ceilings: device copy bandwidth");
                c.gpu_copy_gbps = Some(copy::gpu_bandwidth(
                    &dev,
                    if quick { 256 << 20 } else { 1 << 30 },
                )?);
                let n = if quick { 2048 } else { 4096 };
                for (dtype, prec, label) in [
                    (DType::F32, Precision::F32, "f32"),
                    (DType::F32, Precision::Tf32, "tf32"),
                    (DType::BF16, Precision::Bf16, "bf16"),
                    (DType::F16, Precision::F16, "f16"),
                ] {
                    progress(&format!("ceilings: cuBLAS {label} {n}³"));
                    let gflops = cublas_gflops(i, dtype, prec, n)?;
                    c.gpu_gemm_gflops.push((label.into(), gflops));
                }
            }
        }
    }
    Ok(c)
}

/// The CPU peer's (the `gemm` crate's) multi-threaded rate on an n³ f32 GEMM, GFLOP/s.
#[cfg(feature = "bench")]
fn cpu_peer_gflops(quick: bool) -> Result<Option<f64>> {
    let n = if quick { 512 } else { 1024 };
    let a = Tensor::rand(&[n, n], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
    let mut out = vec![0f32; n * n];
    let s = a.with_cpu::<f32, _>(|a_s| {
        crate::core::harness::bench::time_cpu(Budget::cpu(), || {
            matmul::cpu::peer(
                matmul::cpu::Sgemm {
                    m: n,
                    n,
                    k: n,
                    alpha: 1.0,
                    beta: 0.0,
                    a: a_s,
                    lda: n,
                    a_trans: false,
                    b: a_s,
                    ldb: n,
                    b_trans: false,
                    c: &mut out,
                    ldc: n,
                },
                0,
            )
        })
    })?;
    Ok(Some(2.0 * (n as f64).powi(3) / (s.median_ms * 1e-3) / 1e9))
}

/// Without the `bench` feature there is no CPU peer to measure.
#[cfg(not(feature = "bench"))]
fn cpu_peer_gflops(_quick: bool) -> Result<Option<f64>> {
    Ok(None)
}

/// cuBLAS's rate (GFLOP/s, median of timed runs) for an n³ GEMM of `dtype` at `prec` on GPU `i`:
/// the ceiling benches and the trainer's MFU are measured against.
pub fn cublas_gflops(i: usize, dtype: DType, prec: Precision, n: usize) -> Result<f64> {
    let dev = cuda::device(i)?;
    let dd = Device::Cuda(i);
    let a = Tensor::rand(&[n, n], dtype, dd, 1, -1.0, 1.0)?;
    let b = Tensor::rand(&[n, n], dtype, dd, 2, -1.0, 1.0)?;
    let o = Tensor::empty(&[n, n], dtype, dd)?;
    let g = matmul::validate(&a, &b, &o)?;
    let p = matmul::cuda::Ptrs {
        a: a.device_ptr()?,
        b: b.device_ptr()?,
        c: o.device_ptr()?,
    };
    let stream = dev.stream().clone();
    let s = time_gpu(&dev, &stream, Budget::gpu(), |_| {
        matmul::cuda::cublas(&dev, &g, p, 1.0, 0.0, prec, &stream)
    })?;
    Ok(g.flops() / (s.median_ms * 1e-3) / 1e9)
}

/// One compiled kernel's resource report from ptxas.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelBuild {
    /// The module's label (family, file and specialisation).
    pub module: String,
    /// The entry point.
    pub function: String,
    /// The target it was built for.
    pub arch: String,
    /// The PTX came from the disk cache.
    pub from_cache: bool,
    /// Registers per thread (with ptxas).
    pub registers: Option<u32>,
    /// Static shared memory, bytes (with ptxas).
    pub smem_bytes: Option<u32>,
    /// Stack frame per thread, bytes (with ptxas).
    pub stack_bytes: Option<u32>,
    /// Bytes spilled to local memory (with ptxas; CI refuses any).
    pub spill_stores: Option<u32>,
    /// Bytes loaded back from spills (with ptxas).
    pub spill_loads: Option<u32>,
}

/// What [`warm_kernel_cache`] did: modules compiled now, read from the disk cache, or failed
/// (a failure is left for the rung that launches the module to report, in its own context).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheWarmth {
    /// Compiled by NVRTC in this call.
    pub compiled: usize,
    /// Already in the disk cache.
    pub cached: usize,
    /// NVRTC refused them.
    pub failed: usize,
}

/// Fills the kernel cache for `arch` with every module the families list, compiled on all cores,
/// before a run that will launch many of them: each module is otherwise compiled the first time
/// one of its kernels runs, one after another (on a fresh machine `bench all`'s rungs spent most
/// of their first run in NVRTC). Modules already cached cost a hash and a file read each.
/// `progress(done, total)` is called as modules finish.
pub fn warm_kernel_cache(
    fams: &[&'static dyn OpFamily],
    arch: Arch,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> CacheWarmth {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let specs: Vec<KernelSpec> = fams
        .iter()
        .flat_map(|f| f.kernels())
        .filter(|s| arch >= s.min_arch)
        .collect();
    let done = AtomicUsize::new(0);
    let outcomes: Vec<Option<bool>> = specs
        .par_iter()
        .map(|spec| {
            let r = jit::compile(&spec.program, arch).ok().map(|c| c.from_cache);
            progress(done.fetch_add(1, Ordering::Relaxed) + 1, specs.len());
            r
        })
        .collect();
    let count = |want: Option<bool>| outcomes.iter().filter(|o| **o == want).count();
    CacheWarmth {
        compiled: count(Some(false)),
        cached: count(Some(true)),
        failed: count(None),
    }
}

/// Compiles every kernel of every family for `archs` through the runtime's own JIT path (no GPU
/// needed) and, when `ptxas` is given, assembles each PTX and reads its resource report.
/// `only`: keep the modules whose label contains this text.
pub fn build_kernels(
    archs: &[Arch],
    ptxas: Option<&std::path::Path>,
    out_dir: Option<&std::path::Path>,
    only: Option<&str>,
) -> Result<Vec<KernelBuild>> {
    use rayon::prelude::*;
    // Every (module, arch) pair is independent: compile them on all cores (NVRTC and ptxas are
    // single-threaded; hundreds of specialisations make this the slow step of CI).
    let jobs: Vec<(KernelSpec, Arch)> = registry()
        .into_iter()
        .flat_map(|fam| fam.kernels())
        .chain(std::iter::once(KernelSpec {
            program: crate::data::bench::sim_program(),
            functions: vec!["sim_compute".into()],
            min_arch: Arch::SM80,
        }))
        .chain(crate::train::glue::kernel_specs())
        .filter(|spec| only.is_none_or(|o| spec.program.label().contains(o)))
        .flat_map(|spec| {
            archs
                .iter()
                .filter(|a| **a >= spec.min_arch)
                .map(|&a| (spec.clone(), a))
                .collect::<Vec<_>>()
        })
        .collect();
    // Progress on stderr (CI runs this for minutes): every tenth of the jobs.
    let done = std::sync::atomic::AtomicUsize::new(0);
    let total = jobs.len();
    let per_job: Vec<Result<Vec<KernelBuild>>> = jobs
        .par_iter()
        .map(|(spec, arch)| {
            let r = build_one(spec, *arch, ptxas, out_dir);
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if n.is_multiple_of(total.div_ceil(10).max(1)) || n == total {
                eprintln!("kernels: {n}/{total} modules built");
            }
            r
        })
        .collect();
    let mut builds = Vec::new();
    for r in per_job {
        builds.extend(r?);
    }
    Ok(builds)
}

fn build_one(
    spec: &KernelSpec,
    arch: Arch,
    ptxas: Option<&std::path::Path>,
    out_dir: Option<&std::path::Path>,
) -> Result<Vec<KernelBuild>> {
    let compiled = jit::compile(&spec.program, arch)?;
    let report = match ptxas {
        Some(p) => Some(ptxas_report(p, &compiled, out_dir)?),
        None => None,
    };
    let mut builds = Vec::new();
    for f in &spec.functions {
        if !compiled.ptx.contains(&format!(".entry {f}(")) {
            return Err(Error::Other(format!(
                "{}: PTX has no entry `{f}` for {}",
                compiled.label,
                arch.target()
            )));
        }
        let r = report
            .as_ref()
            .and_then(|r| r.iter().find(|(name, _)| name == f))
            .map(|(_, r)| r.clone());
        builds.push(KernelBuild {
            module: compiled.label.clone(),
            function: f.clone(),
            arch: arch.target().into(),
            from_cache: compiled.from_cache,
            registers: r.as_ref().and_then(|r| r.registers),
            smem_bytes: r.as_ref().and_then(|r| r.smem_bytes),
            stack_bytes: r.as_ref().and_then(|r| r.stack_bytes),
            spill_stores: r.as_ref().and_then(|r| r.spill_stores),
            spill_loads: r.as_ref().and_then(|r| r.spill_loads),
        });
    }
    Ok(builds)
}

#[derive(Clone, Debug, Default)]
struct PtxasFunc {
    registers: Option<u32>,
    smem_bytes: Option<u32>,
    stack_bytes: Option<u32>,
    spill_stores: Option<u32>,
    spill_loads: Option<u32>,
}

fn num_before(s: &str, unit: &str) -> Option<u32> {
    let i = s.find(unit)?;
    s[..i].split_whitespace().last()?.parse().ok()
}

/// Runs `ptxas -v` on the PTX; returns (function, resources) pairs. A ptxas error is an error.
fn ptxas_report(
    ptxas: &std::path::Path,
    c: &jit::CompiledPtx,
    out_dir: Option<&std::path::Path>,
) -> Result<Vec<(String, PtxasFunc)>> {
    let dir = out_dir
        .map(|p| p.to_path_buf())
        .unwrap_or_else(|| std::env::temp_dir().join("ferrite-ptxas"));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let stem = format!(
        "{}-{}-{}",
        c.label.replace(['/', '[', ']', ',', '=', ' '], "_"),
        c.arch.target(),
        &c.key[..8]
    );
    // ptxas's report is a function of the PTX (c.key hashes its source, options and NVRTC) and
    // of the ptxas binary: kept beside the PTX cache, a rebuild of unchanged modules skips ptxas.
    let tool_id = std::fs::metadata(ptxas)
        .map(|m| {
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            format!("{}-{}", m.len(), t.map_or(0, |t| t.as_secs()))
        })
        .unwrap_or_default();
    let cached =
        jit::cache_dir()
            .join("ptxas")
            .join(format!("{}-{}-{tool_id}.log", c.key, c.arch.target()));
    if out_dir.is_none() {
        if let Ok(log) = std::fs::read_to_string(&cached) {
            return Ok(parse_ptxas(&log));
        }
    }
    let ptx = dir.join(format!("{stem}.ptx"));
    std::fs::write(&ptx, &c.ptx).map_err(|e| Error::io(format!("writing {}", ptx.display()), e))?;
    let cubin = dir.join(format!("{stem}.cubin"));
    let o = std::process::Command::new(ptxas)
        .arg(format!("-arch={}", c.arch.target()))
        .arg("-v")
        .arg(&ptx)
        .arg("-o")
        .arg(&cubin)
        .output()
        .map_err(|e| Error::io(format!("running {}", ptxas.display()), e))?;
    let log = String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    if out_dir.is_none() {
        // Scratch files only (the caller asked for no output folder): hundreds of MB otherwise.
        let _ = std::fs::remove_file(&ptx);
        let _ = std::fs::remove_file(&cubin);
    }
    if !o.status.success() {
        return Err(Error::Compile {
            module: c.label.clone(),
            arch: c.arch.target().into(),
            options: "ptxas -v".into(),
            log,
        });
    }
    if std::fs::create_dir_all(cached.parent().unwrap()).is_ok() {
        let _ = std::fs::write(&cached, &log);
    }
    Ok(parse_ptxas(&log))
}

/// (function, resources) pairs from ptxas -v's log.
fn parse_ptxas(log: &str) -> Vec<(String, PtxasFunc)> {
    let mut funcs: Vec<(String, PtxasFunc)> = Vec::new();
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            funcs.push((name, PtxasFunc::default()));
        } else if let Some((_, f)) = funcs.last_mut() {
            if line.contains("bytes stack frame") {
                f.stack_bytes = num_before(line, "bytes stack frame");
                f.spill_stores = num_before(line, "bytes spill stores");
                f.spill_loads = num_before(line, "bytes spill loads");
            }
            if line.contains("Used") && line.contains("registers") {
                f.registers = num_before(line, "registers");
                f.smem_bytes = num_before(line, "bytes smem").or(Some(0));
            }
        }
    }
    funcs
}

#[cfg(test)]
mod layer_tests {
    use super::FAMILY_DEPENDENCIES;
    use std::path::Path;

    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// Every `crate::ops::<other family>` path in a family's sources is a declared dependency.
    #[test]
    fn families_use_only_core_and_their_declared_dependencies() {
        let ops = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops");
        let families: Vec<String> = std::fs::read_dir(&ops)
            .unwrap()
            .filter_map(|e| {
                let p = e.unwrap().path();
                p.is_dir()
                    .then(|| p.file_name().unwrap().to_string_lossy().into_owned())
            })
            .collect();
        assert!(families.len() >= 12, "{families:?}");
        let mut bad = Vec::new();
        for fam in &families {
            let mut files = Vec::new();
            rust_files(&ops.join(fam), &mut files);
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap();
                for (n, line) in text.lines().enumerate() {
                    for other in &families {
                        let used = line.contains(&format!("crate::ops::{other}::"))
                            || line.contains(&format!("crate::ops::{other}}}"))
                            || line.contains(&format!("crate::ops::{other};"))
                            || line.contains(&format!("crate::ops::{{{other}"));
                        if other != fam
                            && used
                            && !FAMILY_DEPENDENCIES.contains(&(fam.as_str(), other.as_str()))
                        {
                            bad.push(format!("{}:{}: {fam} → {other}", f.display(), n + 1));
                        }
                    }
                }
            }
        }
        assert!(
            bad.is_empty(),
            "undeclared cross-family imports:\n{}",
            bad.join("\n")
        );
    }
}

#[cfg(test)]
mod warm_tests {
    use super::*;

    /// Every module of the families is accounted for (compiled now or read back), none fails, and
    /// a second warm-up compiles nothing: the cache the rungs will read is full.
    #[test]
    fn warming_fills_the_cache_the_rungs_read() {
        if cuda::nvrtc_available().is_err() {
            eprintln!("NVRTC not available: skipped");
            return;
        }
        let fams = vec![family("copy").unwrap(), family("softmax").unwrap()];
        let total: usize = fams
            .iter()
            .map(|f| {
                f.kernels()
                    .iter()
                    .filter(|s| Arch::SM80 >= s.min_arch)
                    .count()
            })
            .sum();
        assert!(total >= 2, "the two families list their modules");
        let seen = std::sync::atomic::AtomicUsize::new(0);
        let first = warm_kernel_cache(&fams, Arch::SM80, &|done, n| {
            assert!(done <= n && n == total);
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(first.failed, 0);
        assert_eq!(first.compiled + first.cached, total);
        assert_eq!(seen.into_inner(), total, "progress once per module");
        let again = warm_kernel_cache(&fams, Arch::SM80, &|_, _| {});
        assert_eq!(
            again,
            CacheWarmth {
                compiled: 0,
                cached: total,
                failed: 0
            }
        );
        // A listed module compiled afterwards (as a rung does at its first launch) is read back.
        let spec = &fams[1].kernels()[0];
        assert!(jit::compile(&spec.program, Arch::SM80).unwrap().from_cache);
    }
}
