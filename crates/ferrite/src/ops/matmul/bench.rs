//! `ferrite bench matmul`: the ladder on each device, with the peer (the `gemm` crate on the CPU,
//! cuBLAS on the GPU) measured in the same run on the same inputs.

use super::cuda::{self as mm_cuda, Ptrs};
use super::{cpu, validate, variants, Gemm, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    relate, rotation_sets, time_cpu, time_gpu_alternating_boxed, BenchRecord, Budget,
    ALTERNATING_ROUNDS,
};
use crate::core::harness::{BenchConfig, Ceilings, Precision, Stats};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use std::sync::Arc;

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &dev in &cfg.devices {
        match dev {
            // The sweep compares the GPU default with the vendor libraries: no CPU rows.
            Device::Cpu if cfg.sweep => {}
            Device::Cpu => bench_cpu(cfg, ceilings, progress, out)?,
            Device::Cuda(i) if cfg.sweep => super::sweep::run(cfg, &device(i)?, progress, out)?,
            Device::Cuda(i) => bench_gpu(cfg, &device(i)?, ceilings, progress, out)?,
        }
    }
    Ok(())
}

fn bench_cpu(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    let defaults: &[[usize; 3]] = if cfg.quick {
        &[[256, 256, 256], [512, 512, 512]]
    } else if cfg.representative {
        // Representative: 1024³, the size the CPU peer's ceiling is measured at, and 512³, the
        // one size `naive` runs at (1.7 s per call at 1024³): the whole ladder, with its peer.
        &[[512, 512, 512], [1024, 1024, 1024]]
    } else {
        &[[512, 512, 512], [1024, 1024, 1024], [2048, 2048, 2048]]
    };
    let explicit = !cfg.shapes.is_empty();
    let threads = rayon::current_num_threads();
    let name = crate::core::harness::cpu_name();
    for [m, n, k] in cfg.shapes_3d(defaults) {
        let a = Tensor::rand(&[m, k], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
        let b = Tensor::rand(&[k, n], DType::F32, Device::Cpu, 2, -1.0, 1.0)?;
        let c = Tensor::empty(&[m, n], DType::F32, Device::Cpu)?;
        let g = validate(&a, &b, &c)?;
        let mut group: Vec<BenchRecord> = Vec::new();
        let runs: Vec<(&str, bool)> = variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
            .map(|v| (v.name, false))
            // The peer always runs when built in (feature `bench`): every ratio is to it.
            .chain(cfg!(feature = "bench").then_some(("gemm-crate", true)))
            .collect();
        for (vname, is_peer) in runs {
            // The triple loop takes seconds per repeat beyond 512³: run it there only on request.
            if vname == "naive" && !explicit && m * n * k > 512 * 512 * 512 {
                continue;
            }
            progress(&format!("matmul cpu {vname} {}", g.label()));
            let vthreads = if matches!(vname, "parallel" | "gemm-crate") {
                threads
            } else {
                1
            };
            let stats = a.with_cpu::<f32, _>(|a_s| {
                b.with_cpu::<f32, _>(|b_s| {
                    c.with_cpu_mut::<f32, _>(|c_s| {
                        time_cpu(Budget::cpu(), || {
                            let s = cpu::Sgemm {
                                m,
                                n,
                                k,
                                alpha: 1.0,
                                beta: 0.0,
                                a: a_s,
                                lda: k,
                                a_trans: false,
                                b: b_s,
                                ldb: n,
                                b_trans: false,
                                c: &mut *c_s,
                                ldc: n,
                            };
                            match vname {
                                "naive" => cpu::naive(s),
                                "blocked" => cpu::blocked(s),
                                "simd" => cpu::simd(s),
                                "parallel" => cpu::parallel(s, 0),
                                #[cfg(feature = "bench")]
                                "gemm-crate" => cpu::peer(s, 0),
                                other => unreachable!("matmul bench: no CPU run `{other}`"),
                            }
                        })
                    })
                })
            })???;
            let mut r = BenchRecord::new(
                Device::Cpu,
                &name,
                OP,
                vname,
                DType::F32,
                g.label(),
                stats,
                g.flops(),
                g.min_bytes(0.0),
            );
            r.is_peer = is_peer;
            r.config = match vname {
                "simd" => format!("{} micro-kernel, 1 thread", cpu::simd_isa()),
                "parallel" => format!("{} micro-kernel, {threads} threads", cpu::simd_isa()),
                "gemm-crate" => format!("gemm 0.18, {threads} threads"),
                _ => "1 thread".into(),
            };
            if let Some(peak) = ceilings.cpu_core_peak_gflops {
                let p = peak * vthreads as f64;
                r.pct_of_ceiling = Some(100.0 * r.tflops * 1e3 / p);
                r.ceiling = format!(
                    "nominal peak {p:.0} GFLOP/s ({vthreads} core{})",
                    if vthreads > 1 { "s" } else { "" }
                );
            }
            group.push(r);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
    }
    Ok(())
}

/// Input sets for rotation: (a, b, c) per set, so a pass over them exceeds L2. With `b_trans`, B
/// is stored [n, k] and passed as its transposed view (the NT layout of a linear layer);
/// `b_trans: Some(b)` takes B's values from the host tensor `b` (`[n, k]`) instead of drawing them.
pub(super) fn gpu_sets(
    dev: &Arc<CudaDevice>,
    dtype: DType,
    [m, n, k]: [usize; 3],
    b_trans: Option<&Tensor>,
) -> Result<Vec<(Tensor, Tensor, Tensor)>> {
    let d = Device::Cuda(dev.ordinal());
    let es = dtype.size_in_bytes();
    let per_set = (m * k + k * n + m * n) * es;
    let (free, _) = dev
        .context()
        .mem_get_info()
        .map_err(|e| crate::core::error::Error::cuda("cuMemGetInfo", e))?;
    let sets = rotation_sets(per_set, dev.props().l2_bytes, free as u64);
    // One random set on the host, copied to every slot: random data, without paying the host RNG
    // once per set.
    let a = Tensor::rand(&[m, k], dtype, Device::Cpu, 11, -1.0, 1.0)?;
    let drawn;
    let b = match b_trans {
        Some(b) => b,
        None => {
            drawn = Tensor::rand(&[k, n], dtype, Device::Cpu, 12, -1.0, 1.0)?;
            &drawn
        }
    };
    (0..sets)
        .map(|_| {
            let bd = b.to_device(d)?;
            Ok((
                a.to_device(d)?,
                if b_trans.is_some() {
                    bd.transpose(0, 1)?
                } else {
                    bd
                },
                Tensor::empty(&[m, n], dtype, d)?,
            ))
        })
        .collect()
}

/// A GPU record of `g` on device `d` (named `name`): `variant`'s times, its FLOPs and the
/// problem's least bytes, the dtype shown as `label` (tf32 is f32 storage).
pub(super) fn gemm_record(
    (d, name): (Device, &str),
    variant: &str,
    (dtype, label): (DType, &str),
    g: &Gemm,
    stats: Stats,
) -> BenchRecord {
    let mut r = BenchRecord::new(
        d,
        name,
        OP,
        variant,
        dtype,
        g.label(),
        stats,
        g.flops(),
        g.min_bytes(0.0),
    );
    r.dtype = label.into();
    r
}

/// The device pointers of each rotation set (`gpu_sets`).
pub(super) fn set_ptrs(sets: &[(Tensor, Tensor, Tensor)]) -> Result<Vec<Ptrs>> {
    sets.iter()
        .map(|(a, b, c)| {
            Ok(Ptrs {
                a: a.device_ptr()?,
                b: b.device_ptr()?,
                c: c.device_ptr()?,
            })
        })
        .collect()
}

/// The GPU groups: (input dtype, precision, label in the records). tf32 is f32 storage run by the
/// tensor-core variants, against cuBLAS with CUBLAS_COMPUTE_32F_FAST_TF32.
const GPU_GROUPS: [(DType, Precision, &str); 4] = [
    (DType::F32, Precision::F32, "f32"),
    (DType::F32, Precision::Tf32, "tf32"),
    (DType::BF16, Precision::Bf16, "bf16"),
    (DType::F16, Precision::F16, "f16"),
];

/// Default shapes for the tensor-core precisions beyond the cube (full mode only): 8192³ and the
/// LLM projections with M = 8192 tokens (N×K = 4096×4096, 14336×4096, 4096×14336). Only the
/// tensor-core variants and cuBLAS run these; the SIMT rungs and naive run the cube alone.
const TC_LARGE: &[[usize; 3]] = &[
    [8192, 8192, 8192],
    [8192, 4096, 4096],
    [8192, 14336, 4096],
    [8192, 4096, 14336],
];

/// Decode shapes (full mode, bf16/f16), in the NT layout of a linear layer's weight: one token,
/// 16 and 64 sequences through Llama-3-8B-like projections (4096², 14336×4096, 4096×14336), and
/// GPT-2's and Llama-3's vocabulary heads. Bandwidth-bound: the GB/s column is the figure.
const DECODE: &[[usize; 3]] = &[
    [1, 4096, 4096],
    [1, 14336, 4096],
    [16, 14336, 4096],
    [64, 14336, 4096],
    [1, 4096, 14336],
    [1, 50257, 768],
    [16, 50257, 768],
    [1, 128256, 4096],
];

/// The GPU groups a run times: those of the dtypes asked for, else all of them, or in
/// representative scope bf16 (the headline: `wgmma` against cuBLAS at 4096³) and true f32 (the
/// SIMT rungs run no other dtype): every variant of the ladder once, at the cube alone.
fn gpu_groups(cfg: &BenchConfig) -> Vec<(DType, Precision, &'static str)> {
    GPU_GROUPS
        .into_iter()
        .filter(|g| cfg.wants_dtype(g.0))
        .filter(|g| {
            !cfg.representative
                || !cfg.dtypes.is_empty()
                || matches!(g.1, Precision::F32 | Precision::Bf16)
        })
        .collect()
}

fn bench_gpu(
    cfg: &BenchConfig,
    dev: &Arc<CudaDevice>,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let cube = if cfg.quick { 2048 } else { 4096 };
    let stream = dev.stream().clone();
    let name = dev.props().name.clone();
    let d = Device::Cuda(dev.ordinal());
    for (dtype, prec, label) in gpu_groups(cfg) {
        let tf32 = prec == Precision::Tf32;
        let mut defaults = vec![[cube; 3]];
        if !cfg.quick && !cfg.representative && prec != Precision::F32 {
            defaults.extend_from_slice(TC_LARGE);
        }
        let mut runs_of: Vec<([usize; 3], bool)> = cfg
            .shapes_3d(&defaults)
            .into_iter()
            .map(|s| (s, false))
            .collect();
        // tf32 also in the NT layout (B stored [n, k], a linear layer's weight): the layout tf32
        // `wgmma` reads in place; NN first packs B K-major (its transpose pre-pass is timed). Not
        // in representative scope (the same rungs again), nor are the decode shapes below.
        if tf32 && !cfg.representative {
            let first = runs_of[0].0;
            runs_of.insert(1, (first, true));
        }
        // Short A (decode): asked-for shapes also in the NT layout, where `skinny` runs; the
        // default decode shapes in NT only.
        if matches!(prec, Precision::Bf16 | Precision::F16) {
            let short: Vec<_> = runs_of
                .iter()
                .filter(|(s, bt)| !bt && s[0] <= mm_cuda::SKINNY_MAX_M)
                .map(|&(s, _)| (s, true))
                .collect();
            runs_of.extend(short);
            if cfg.shapes.is_empty() && !cfg.quick && !cfg.representative {
                runs_of.extend(DECODE.iter().map(|&s| (s, true)));
            }
        }
        for (shape, b_trans) in runs_of {
            // Beyond the default cube in NN, only the tensor-core variants (unless shapes were
            // asked for).
            let tc_only = (cfg.shapes.is_empty() && shape != [cube; 3]) || b_trans;
            let runs: Vec<&'static str> = variants()
                .iter()
                .filter(|v| {
                    let tc = mm_cuda::tensor_core(v.name);
                    v.backend == Backend::Cuda
                        && v.dtypes.contains(&dtype)
                        && cfg.wants_variant(v.name)
                        && (dtype != DType::F32 || tc == tf32)
                        && (tc || !tc_only)
                })
                .map(|v| v.name)
                .collect();
            if runs.is_empty() && !cfg.variants.is_empty() {
                continue;
            }
            let b_nk = if b_trans {
                Some(Tensor::rand(
                    &[shape[1], shape[2]],
                    dtype,
                    Device::Cpu,
                    12,
                    -1.0,
                    1.0,
                )?)
            } else {
                None
            };
            let sets = gpu_sets(dev, dtype, shape, b_nk.as_ref())?;
            let g: Gemm = validate(&sets[0].0, &sets[0].1, &sets[0].2)?;
            let ptrs = set_ptrs(&sets)?;
            // Plans first (`wgmma` runs its tuned configuration, timed here at the shape's first
            // use and remembered in tune.json, which the config column names), then every
            // variant and both vendor peers timed in alternating rounds under one clock history.
            // `--config` names replace the tuned `wgmma` launch by one row per configuration.
            let mut plans = Vec::new();
            for vname in runs {
                let declines = match vname {
                    "skinny" => mm_cuda::skinny_declines(&g),
                    "wgmma" => mm_cuda::wgmma_declines(&g),
                    _ => None,
                };
                if declines.is_some() {
                    continue;
                }
                progress(&format!("matmul {d} {vname} {label} {}", g.label()));
                if vname != "wgmma" {
                    plans.push((vname, mm_cuda::plan(vname, &g, dev)?, None));
                } else if cfg.configs.is_empty() {
                    let c = mm_cuda::wg_tuned(&g, ptrs[0], dev, &stream)?;
                    plans.push((
                        vname,
                        mm_cuda::plan_with(vname, &g, dev, c)?,
                        Some((c, true)),
                    ));
                } else {
                    for name in &cfg.configs {
                        let c = mm_cuda::wg_config_named(name)?;
                        plans.push((
                            vname,
                            mm_cuda::plan_with(vname, &g, dev, c)?,
                            Some((c, false)),
                        ));
                    }
                }
            }
            // The second vendor peer: cuBLASLt with its heuristic's pick, planned once. A
            // failure (no libcublasLt, no algorithm) leaves the row out rather than the group.
            let lt = match mm_cuda::LtPlan::new(dev, &g, prec, &stream) {
                Ok(plan) => Some(plan),
                Err(e) => {
                    progress(&format!("matmul {d} cublaslt {label}: skipped ({e})"));
                    None
                }
            };
            progress(&format!(
                "matmul {d} timing {label} {} (alternating rounds)",
                g.label()
            ));
            let n = ptrs.len();
            let (g_, ptrs_, stream_) = (&g, &ptrs, &stream);
            let mut fs: Vec<Box<dyn FnMut(usize) -> Result<()> + '_>> = plans
                .iter()
                .map(|(_, l, _)| {
                    Box::new(move |i: usize| {
                        mm_cuda::launch(l, g_, ptrs_[i % n], 1.0, 0.0, stream_)
                    }) as Box<dyn FnMut(usize) -> Result<()>>
                })
                .collect();
            fs.push(Box::new(move |i: usize| {
                mm_cuda::cublas(dev, g_, ptrs_[i % n], 1.0, 0.0, prec, stream_)
            }));
            if let Some(plan) = &lt {
                fs.push(Box::new(move |i: usize| plan.run(ptrs_[i % n], 1.0, 0.0)));
            }
            let mut stats = time_gpu_alternating_boxed(
                dev,
                &stream,
                Budget::gpu(),
                ALTERNATING_ROUNDS,
                &mut fs,
            )?
            .into_iter();
            drop(fs);
            let mut group = Vec::new();
            for (vname, l, tuned) in &plans {
                let r = gemm_record(
                    (d, &name),
                    vname,
                    (dtype, label),
                    &g,
                    stats.next().expect("one Stats per closure"),
                );
                let mut r = r.with_kernel(&l.kernel, l.block.0 * l.block.1 * l.block.2, l.smem)?;
                r.config = match tuned {
                    Some((c, true)) => {
                        format!("tuned {c} of {}: {}", mm_cuda::WG_CONFIGS.len(), l.config)
                    }
                    Some((c, false)) => format!("given {c}: {}", l.config),
                    None => l.config.clone(),
                };
                group.push(r);
            }
            let peer = |variant: &str, stats, config: String| {
                let mut r = gemm_record((d, &name), variant, (dtype, label), &g, stats);
                r.is_peer = true;
                r.config = config;
                r
            };
            group.push(peer(
                "cublas",
                stats.next().expect("one Stats per closure"),
                format!(
                    "cublasGemmStridedBatchedEx, {} compute",
                    match prec {
                        Precision::F32 => "fp32",
                        Precision::Tf32 => "fast-tf32",
                        _ => "fp32-accumulate",
                    }
                ),
            ));
            if let Some(plan) = &lt {
                let s = stats.next().expect("one Stats per closure");
                group.push(peer("cublaslt", s, plan.config.clone()));
            }
            let ceiling_label = format!("cuBLAS {cube}³");
            let ceiling = ceilings
                .gpu_gemm(label)
                .map(|v| (ceiling_label.as_str(), v, true));
            relate(&mut group, "naive", ceiling);
            out.extend(group);
        }
    }
    Ok(())
}
