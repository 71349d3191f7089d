//! `ferrite bench cross_entropy`: forward + backward (loss and dlogits) at GPT-2's and Llama-3's
//! vocabularies, unfused (`naive`) vs `fused`. Bytes are counted as the ideal — the logits read
//! once and dlogits written once — so GB/s and % of the device copy bandwidth say how close a
//! variant is to a copy of the logits. The fused kernel reads the row twice (the second time
//! mostly from L2), so its floor in DRAM traffic is between 2 and 3 passes' worth; 100% of copy
//! on the ideal count is unreachable unless the second read always hits L2.

use super::cuda::{self as cc, Ptrs, Scratch};
use super::{variants, CrossEntropyOptions, GradOut, Problem, Reduction, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu, BenchRecord, Budget, Stats,
};
use crate::core::harness::{BenchConfig, Ceilings};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use std::sync::Arc;

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &d in &cfg.devices {
        match d {
            Device::Cpu => bench_cpu(cfg, progress, out)?,
            Device::Cuda(i) => bench_gpu(cfg, &device(i)?, ceilings, progress, out)?,
        }
    }
    Ok(())
}

/// Random targets in [0, V).
fn targets(n: usize, v: usize, dev: Device) -> Result<Tensor> {
    let t = Tensor::rand(&[n], DType::I32, Device::Cpu, 7, 0.0, v as f64)?;
    let t: Vec<i64> = t.to_vec::<i32>()?.into_iter().map(i64::from).collect();
    Tensor::from_vec(t, &[n])?.to_device(dev)
}

fn shapes(cfg: &BenchConfig, gpu: bool) -> Vec<[usize; 2]> {
    if !cfg.shapes.is_empty() {
        return cfg.shapes_2d([0, 0]);
    }
    let n = match (gpu, cfg.quick) {
        (true, false) => 8192,
        (true, true) => 2048,
        (false, false) => 256,
        (false, true) => 32,
    };
    // Representative: GPT-2's vocabulary (the README's first figure), not Llama-3's.
    cfg.scope(&[[n, 50257], [n, 128256]]).to_vec()
}

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    let name = crate::core::harness::cpu_name();
    for [n, v] in shapes(cfg, false) {
        let x = Tensor::rand(&[n, v], DType::F32, Device::Cpu, 1, -8.0, 8.0)?;
        let t = targets(n, v, Device::Cpu)?;
        let lr = Tensor::empty(&[n], DType::F32, Device::Cpu)?;
        let l = Tensor::empty(&[1], DType::F32, Device::Cpu)?;
        let g = Tensor::empty(&[n, v], DType::F32, Device::Cpu)?;
        let mut group = Vec::new();
        for var in variants()
            .iter()
            .filter(|x| x.backend == Backend::Cpu && cfg.wants_variant(x.name))
        {
            progress(&format!("cross_entropy cpu {} {n}×{v}", var.name));
            let opts = CrossEntropyOptions {
                variant: Some(var.name.into()),
                ..Default::default()
            };
            let s = time_cpu_op(Budget::cpu(), || {
                super::cross_entropy_into(&x, &t, &lr, Some(&l), GradOut::Into(&g), &opts)
            })?;
            let mut rec = BenchRecord::new(
                Device::Cpu,
                &name,
                OP,
                var.name,
                DType::F32,
                format!("{n}×{v} fwd+bwd"),
                s,
                0.0,
                8.0 * (n * v) as f64,
            );
            rec.config = cpu_threads_note(var.name != "naive");
            group.push(rec);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
    }
    Ok(())
}

fn bench_gpu(
    cfg: &BenchConfig,
    dev: &Arc<CudaDevice>,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let d = Device::Cuda(dev.ordinal());
    let stream = dev.stream().clone();
    let name = dev.props().name.clone();
    let ceiling = ceilings.gpu_copy_gbps.map(|v| ("device copy", v, false));
    for dtype in [DType::BF16, DType::F32]
        .into_iter()
        .filter(|t| cfg.wants_dtype(*t))
    {
        // f32 only when asked for: bf16 is what training feeds the loss.
        if dtype == DType::F32 && cfg.dtypes.is_empty() {
            continue;
        }
        for [n, v] in shapes(cfg, true) {
            let p = Problem {
                rows: n,
                vocab: v,
                ld: v,
                dtype,
                target_dtype: DType::I64,
                device: d,
            };
            let x = Tensor::rand(&[n, v], dtype, d, 1, -8.0, 8.0)?;
            let t = targets(n, v, d)?;
            let lr = Tensor::empty(&[n], DType::F32, d)?;
            let l = Tensor::empty(&[1], DType::F32, d)?;
            let g = Tensor::empty(&[n, v], dtype, d)?;
            let ptrs = Ptrs {
                logits: x.device_ptr()?,
                targets: t.device_ptr()?,
                grad: g.device_ptr()?,
                loss_rows: lr.device_ptr()?,
                loss: l.device_ptr()?,
            };
            // The timed loop never synchronises: the target check is off, as under graph capture.
            let opts = CrossEntropyOptions {
                reduction: Reduction::Mean,
                check_targets: false,
                ..Default::default()
            };
            let ideal = 2.0 * (n * v * dtype.size_in_bytes()) as f64;
            let mut group = Vec::new();
            for var in variants()
                .iter()
                .filter(|x| x.backend == Backend::Cuda && cfg.wants_variant(x.name))
            {
                // `cluster` is timed at every cluster size whose share fits (its rule's pick is
                // marked), so a run shows whether the rule chose well.
                let sizes: Vec<Option<usize>> = if var.name == "cluster" {
                    cc::CLUSTERS.iter().map(|&c| Some(c)).collect()
                } else {
                    vec![None]
                };
                for size in sizes {
                    let cg = if var.name == "cluster" {
                        match cc::cluster_geom(dev, &p, size) {
                            Ok(g) => Some(g),
                            Err(_) => continue, // this cluster size's share does not fit
                        }
                    } else {
                        None
                    };
                    let opts = CrossEntropyOptions {
                        cluster: size,
                        ..opts.clone()
                    };
                    progress(&format!("cross_entropy {d} {} {dtype} {n}×{v}", var.name));
                    let scratch = Scratch::new(var.name, &p, dev, &stream)?;
                    let s = time_gpu(dev, &stream, Budget::gpu(), |_| {
                        cc::launch(var.name, &p, dev, &stream, ptrs, &scratch, &opts)
                    })?;
                    group.push(record(d, &name, var.name, &p, dev, s, ideal, cg)?);
                }
            }
            relate(&mut group, "naive", ceiling);
            out.extend(group);
        }
    }
    Ok(())
}

/// One variant's record: the kernel's resources and the launch shape it ran.
#[allow(clippy::too_many_arguments)]
fn record(
    d: Device,
    device_name: &str,
    variant: &str,
    p: &Problem,
    dev: &Arc<CudaDevice>,
    s: Stats,
    ideal: f64,
    cluster: Option<cc::ClusterGeom>,
) -> Result<BenchRecord> {
    let (n, v, dtype) = (p.rows, p.vocab, p.dtype);
    let rg = cc::resident_geom(dev, p);
    let (prog, kname, threads, smem) = match (variant, cluster) {
        ("fused", _) => (
            cc::program(dtype, DType::I64),
            "ce_fused",
            cc::fused_threads(p),
            0,
        ),
        ("resident", _) => (
            cc::program(dtype, DType::I64),
            "ce_resident",
            rg.threads,
            rg.smem,
        ),
        (_, Some(g)) => (
            cc::cluster_program(dtype, DType::I64, g.cluster),
            "ce_cluster",
            g.threads,
            g.smem,
        ),
        _ => (
            cc::program(dtype, DType::I64),
            "ce_naive_logsoftmax",
            crate::core::cuda::rows::threads_scalar(v),
            0,
        ),
    };
    let k = dev.kernel(&prog, kname)?;
    let mut rec = BenchRecord::new(
        d,
        device_name,
        OP,
        variant,
        dtype,
        format!("{n}×{v} fwd+bwd"),
        s,
        0.0,
        ideal,
    )
    .with_kernel(&k, threads, smem)?;
    rec.config = match (variant, cluster) {
        ("resident", _) => format!("{kname}: {}", rg.describe(p)),
        (_, Some(g)) => {
            let rule = cc::cluster_geom(dev, p, None).ok().map(|r| r.cluster);
            let mark = if rule == Some(g.cluster) {
                " (the rule's pick)"
            } else {
                ""
            };
            format!("{kname}: {}{mark}", g.describe(p))
        }
        _ => format!("{kname}: {threads} threads/row"),
    };
    rec.note = match variant {
        "fused" => "bytes: logits read once + dlogits written once (the kernel reads twice)".into(),
        "resident" => "bytes: logits read once + dlogits written once (the part of a row beyond shared memory is read twice)".into(),
        "cluster" => "bytes: logits read once + dlogits written once (whole rows on chip)".into(),
        _ => format!(
            "bytes as fused; also writes and reads an N×V f32 intermediate ({:.1} GB)",
            (n * v * 4) as f64 / 1e9
        ),
    };
    Ok(rec)
}
