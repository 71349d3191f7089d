//! `ferrite bench scaled_mm`: FP8 e4m3 × e4m3 → bf16 with tensor-wise scales, every rung against
//! cuBLASLt's FP8 matmul in the same interleaved rounds — `cublaslt` (promoted accumulation,
//! torch._scaled_mm's default) is the peer of `wgmma`, `cublaslt_fast` (FAST_ACCUM) the one of
//! `wgmma_fast`. The ceiling is twice the bf16 cuBLAS rate measured at the start of the run
//! (Hopper's FP8 tensor rate).

use super::cuda::{self as sc, LtFp8, Ptrs};
use super::{variants, Problem, ScaledMmOptions, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu_interleaved, BenchRecord, Budget,
};
use crate::core::harness::{BenchConfig, Ceilings};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use std::sync::Arc;

/// Above this many FLOPs the naive rungs are not timed (seconds per call).
const NAIVE_MAX_FLOPS: f64 = 2e10;

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F8E4M3) {
        return Ok(());
    }
    for &d in &cfg.devices {
        match d {
            Device::Cpu => bench_cpu(cfg, progress, out)?,
            Device::Cuda(i) => bench_gpu(cfg, &device(i)?, ceilings, progress, out)?,
        }
    }
    Ok(())
}

struct Operands {
    p: Problem,
    a: Tensor,
    b: Tensor,
    sa: Tensor,
    sb: Tensor,
    out: Tensor,
}

fn operands([m, n, k]: [usize; 3], dev: Device) -> Result<Operands> {
    let e4 = DType::F8E4M3;
    let a = Tensor::rand(&[m, k], e4, dev, 1, -6.0, 6.0)?;
    let b = Tensor::rand(&[n, k], e4, dev, 2, -6.0, 6.0)?;
    let sa = Tensor::full(&[1], DType::F32, dev, 0.05)?;
    let sb = Tensor::full(&[1], DType::F32, dev, 0.02)?;
    let out = Tensor::empty(&[m, n], DType::BF16, dev)?;
    let p = Problem::dense((m, n, k), (e4, e4, DType::BF16), dev);
    Ok(Operands {
        p,
        a,
        b,
        sa,
        sb,
        out,
    })
}

fn shape_label(p: &Problem) -> String {
    format!("{}×{}×{} e4m3→bf16", p.m, p.n, p.k)
}

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let defaults: &[[usize; 3]] = if cfg.quick {
        &[[64, 128, 256]]
    } else {
        &[[128, 256, 512]]
    };
    // Representative: the same single case (every rung).
    for s in cfg.shapes_3d(defaults) {
        let o = operands(s, Device::Cpu)?;
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
        {
            progress(&format!("scaled_mm cpu {} {}", v.name, shape_label(&o.p)));
            let opts = ScaledMmOptions {
                variant: Some(v.name.into()),
                ..Default::default()
            };
            let st = time_cpu_op(Budget::cpu(), || {
                super::scaled_mm_into(&o.a, &o.b, &o.sa, &o.sb, None, &o.out, &opts)
            })?;
            let mut rec = record(
                &o.p,
                Device::Cpu,
                &crate::core::harness::cpu_name(),
                v.name,
                st,
            );
            rec.config = cpu_threads_note(v.name != "naive");
            group.push(rec);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
    }
    Ok(())
}

fn record(
    p: &Problem,
    d: Device,
    name: &str,
    variant: &str,
    st: crate::core::harness::bench::Stats,
) -> BenchRecord {
    let bytes = (p.m * p.k + p.n * p.k) as f64 + 2.0 * (p.m * p.n) as f64;
    BenchRecord::new(
        d,
        name,
        OP,
        variant,
        DType::F8E4M3,
        shape_label(p),
        st,
        p.flops(),
        bytes,
    )
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
    let defaults: &[[usize; 3]] = if cfg.quick {
        &[[2048, 2048, 2048]]
    } else if cfg.representative {
        // Representative: 4096³ against cuBLASLt (the docs' headline; every rung but naive,
        // above NAIVE_MAX_FLOPS) and 1000×1000×1008, the one default shape naive runs at.
        &[[4096, 4096, 4096], [1000, 1000, 1008]]
    } else {
        &[
            [4096, 4096, 4096],
            [8192, 8192, 8192],
            [8192, 14336, 4096],
            [8192, 4096, 14336],
            [1000, 1000, 1008],
        ]
    };
    // Hopper runs FP8 at twice its bf16 tensor rate.
    let ceiling = ceilings
        .gpu_gemm("bf16")
        .map(|g| ("2 × cuBLAS bf16 at 4096³", 2.0 * g, true));
    for s in cfg.shapes_3d(defaults) {
        let o = operands(s, d)?;
        let q = Ptrs::of(&o.a, &o.b, &o.sa, &o.sb, None, &o.out)?;
        let arch = Some(dev.arch());
        // (name, planned launch or cuBLASLt, is the peer)
        let mut runs: Vec<(String, Run, bool)> = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
        {
            if v.name == "naive" && o.p.flops() > NAIVE_MAX_FLOPS
                || v.name.starts_with("wgmma")
                    && super::wgmma_declines(&o.p, arch, &[q.a, q.b]).is_some()
            {
                continue;
            }
            runs.push((
                v.name.into(),
                Run::Ours(sc::plan(v.name, &o.p, dev)?),
                false,
            ));
        }
        if LtFp8::declines(&o.p).is_none() {
            for fast in [false, true] {
                let lt = LtFp8::new(dev, &o.p, q, fast, &stream)?;
                let n = if fast { "cublaslt_fast" } else { "cublaslt" };
                runs.push((n.into(), Run::Lt(lt), !fast));
            }
        }
        progress(&format!("scaled_mm {d} {}", shape_label(&o.p)));
        let mut fs: Vec<Box<dyn FnMut(usize) -> Result<()>>> = runs
            .iter()
            .map(|(_, r, _)| -> Box<dyn FnMut(usize) -> Result<()>> {
                match r {
                    Run::Ours(l) => Box::new(|_| sc::launch(l, &o.p, q, dev, &stream)),
                    Run::Lt(lt) => Box::new(|_| lt.run(q)),
                }
            })
            .collect();
        let mut refs: Vec<&mut dyn FnMut(usize) -> Result<()>> =
            fs.iter_mut().map(|f| f.as_mut() as _).collect();
        let stats = time_gpu_interleaved(dev, &stream, Budget::gpu(), &mut refs)?;
        drop(refs);
        drop(fs);
        let mut group = Vec::new();
        for ((vname, r, is_peer), st) in runs.iter().zip(stats) {
            let mut rec = record(&o.p, d, &name, vname, st);
            match r {
                Run::Ours(l) => {
                    let threads = if l.build.is_some() { 384 } else { 256 };
                    let smem = l.build.map_or(0, |w| w.smem(o.p.out_dtype));
                    rec = rec.with_kernel(&l.kernel, threads, smem)?;
                    rec.config = l.config.clone();
                }
                Run::Lt(lt) => rec.config = lt.config().to_string(),
            }
            rec.is_peer = *is_peer;
            group.push(rec);
        }
        relate(&mut group, "naive", ceiling);
        // The fast rung's peer is cuBLASLt with the same accumulation.
        if let Some(fast_ms) = group
            .iter()
            .find(|r| r.variant == "cublaslt_fast")
            .map(|r| r.median_ms)
        {
            for r in group
                .iter_mut()
                .filter(|r| r.variant.starts_with("wgmma_fast"))
            {
                r.ratio_to_peer = Some(fast_ms / r.median_ms);
                r.peer = "cublaslt_fast".into();
            }
        }
        out.extend(group);
    }
    Ok(())
}

enum Run {
    Ours(sc::Launch),
    Lt(LtFp8),
}
