//! `ferrite bench w8a16`: decoding-shaped products (m = 1…64 rows against Llama-sized weights),
//! every rung against what the user would run without int8 weights, in the same interleaved
//! rounds: cuBLAS on the dequantised bf16 weight (`cublas_bf16`, the peer) and ferrite's own
//! default bf16 matmul (`ferrite_bf16`). The ceiling is the device copy rate: at small m the
//! product streams the weight, so int8 can approach 2× the bf16 time.

use super::cuda::{self as wc, Ptrs};
use super::{variants, Problem, W8a16Options, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu_interleaved, BenchRecord, Budget, Stats,
};
use crate::core::harness::{BenchConfig, Ceilings, Precision};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use crate::ops::matmul::{self, MatmulOptions};
use std::sync::Arc;

/// Above this many multiply-adds the naive CUDA rung is not timed.
const NAIVE_MAX_MACS: f64 = 2e9;

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::BF16) {
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
    w: Tensor,
    s: Tensor,
    out: Tensor,
}

/// bf16 activations in ±1, a random float weight quantised per row (on the host, then moved).
fn operands([m, n, k]: [usize; 3], dev: Device) -> Result<Operands> {
    let a = Tensor::rand(&[m, k], DType::BF16, dev, 1, -1.0, 1.0)?;
    let wf = Tensor::rand(&[n, k], DType::BF16, Device::Cpu, 2, -0.05, 0.05)?;
    let (w, s) = super::quantize_int8(&wf)?;
    let out = Tensor::empty(&[m, n], DType::BF16, dev)?;
    Ok(Operands {
        p: Problem::dense((m, n, k), DType::BF16, dev),
        a,
        w: w.to_device(dev)?,
        s: s.to_device(dev)?,
        out,
    })
}

fn shape_label(p: &Problem) -> String {
    format!("{}×{}×{} bf16×i8", p.m, p.n, p.k)
}

fn record(p: &Problem, d: Device, name: &str, variant: &str, st: Stats, bytes: f64) -> BenchRecord {
    BenchRecord::new(
        d,
        name,
        OP,
        variant,
        DType::BF16,
        shape_label(p),
        st,
        p.flops(),
        bytes,
    )
}

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let defaults: &[[usize; 3]] = if cfg.quick {
        &[[1, 1024, 1024]]
    } else {
        &[[1, 4096, 4096], [8, 2048, 2048]]
    };
    // Representative: one decoded token through a 4096² weight, not the 8-row batch.
    for s in cfg.shapes_3d(cfg.scope(defaults)) {
        let o = operands(s, Device::Cpu)?;
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
        {
            progress(&format!("w8a16 cpu {} {}", v.name, shape_label(&o.p)));
            let opts = W8a16Options {
                variant: Some(v.name.into()),
                ..Default::default()
            };
            let st = time_cpu_op(Budget::cpu(), || {
                super::w8a16_into(&o.a, &o.w, &o.s, None, &o.out, &opts)
            })?;
            let mut rec = record(
                &o.p,
                Device::Cpu,
                &crate::core::harness::cpu_name(),
                v.name,
                st,
                o.p.min_bytes(),
            );
            rec.config = cpu_threads_note(v.name != "naive");
            group.push(rec);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
    }
    Ok(())
}

enum Run {
    Ours(wc::Launch),
    /// cuBLAS on the bf16 weight.
    Cublas(matmul::Gemm, matmul::cuda::Ptrs),
    /// ferrite's default bf16 matmul on the bf16 weight.
    Ferrite,
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
        &[[1, 4096, 4096]]
    } else if cfg.representative {
        // Representative: 1×14336×4096, the shape the docs' ladder and the README quote.
        &[[1, 14336, 4096]]
    } else {
        &[
            [1, 4096, 4096],
            [1, 14336, 4096],
            [1, 4096, 14336],
            [1, 128256, 4096],
            [8, 14336, 4096],
            [16, 14336, 4096],
            [64, 14336, 4096],
        ]
    };
    let ceiling = ceilings.gpu_copy_gbps.map(|v| ("device copy", v, false));
    for s in cfg.shapes_3d(defaults) {
        let o = operands(s, d)?;
        let q = Ptrs::of(&o.a, &o.w, &o.s, None, &o.out)?;
        // The bf16 weight the peers multiply: the same values, dequantised.
        let wd = {
            let codes = o.w.to_f32_vec()?;
            let sc = o.s.to_f32_vec()?;
            let k = o.p.k.max(1);
            let v: Vec<f32> = codes
                .iter()
                .enumerate()
                .map(|(i, c)| c * sc[i / k])
                .collect();
            Tensor::from_vec(v, &[o.p.n, o.p.k])?
                .to_dtype(DType::BF16)?
                .to_device(d)?
        };
        let wt = wd.t()?; // [k, n] view: C = A·Wᵀ
        let pout = Tensor::empty(&[o.p.m, o.p.n], DType::BF16, d)?;
        let g = matmul::validate(&o.a, &wt, &pout)?;
        let gp = matmul::cuda::Ptrs {
            a: o.a.device_ptr()?,
            b: wd.device_ptr()?,
            c: pout.device_ptr()?,
        };
        let mut runs: Vec<(String, Run, bool)> = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
        {
            if v.name == "naive" && o.p.flops() / 2.0 > NAIVE_MAX_MACS
                || v.name == "mma" && super::mma_declines(&o.p, &[q.a, q.w]).is_some()
            {
                continue;
            }
            runs.push((
                v.name.into(),
                Run::Ours(wc::plan(v.name, &o.p, dev)?),
                false,
            ));
        }
        runs.push(("cublas_bf16".into(), Run::Cublas(g, gp), true));
        runs.push(("ferrite_bf16".into(), Run::Ferrite, false));
        progress(&format!("w8a16 {d} {}", shape_label(&o.p)));
        let mopts = MatmulOptions {
            stream: Some(stream.clone()),
            ..Default::default()
        };
        let mut fs: Vec<Box<dyn FnMut(usize) -> Result<()>>> = runs
            .iter()
            .map(|(_, r, _)| -> Box<dyn FnMut(usize) -> Result<()>> {
                match r {
                    Run::Ours(l) => Box::new(|_| wc::launch(l, &o.p, q, dev, &stream)),
                    Run::Cublas(g, gp) => Box::new(|_| {
                        matmul::cuda::cublas(dev, g, *gp, 1.0, 0.0, Precision::Bf16, &stream)
                    }),
                    Run::Ferrite => Box::new(|_| matmul::matmul_into(&o.a, &wt, &pout, &mopts)),
                }
            })
            .collect();
        let mut refs: Vec<&mut dyn FnMut(usize) -> Result<()>> =
            fs.iter_mut().map(|f| f.as_mut() as _).collect();
        let stats = time_gpu_interleaved(dev, &stream, Budget::gpu(), &mut refs)?;
        drop(refs);
        drop(fs);
        let bf16_bytes = 2.0 * (o.p.n * o.p.k + o.p.m * o.p.k + o.p.m * o.p.n) as f64;
        let mut group = Vec::new();
        for ((vname, r, is_peer), st) in runs.iter().zip(stats) {
            let bytes = match r {
                Run::Ours(_) => o.p.min_bytes(),
                _ => bf16_bytes,
            };
            let mut rec = record(&o.p, d, &name, vname, st, bytes);
            match r {
                Run::Ours(l) => {
                    rec = rec.with_kernel(&l.kernel, 256, 0)?;
                    rec.config = l.config.clone();
                }
                Run::Cublas(..) => rec.config = "cuBLAS, dequantised bf16 weight".into(),
                Run::Ferrite => rec.config = "ferrite matmul default, bf16 weight".into(),
            }
            rec.is_peer = *is_peer;
            group.push(rec);
        }
        relate(&mut group, "naive", ceiling);
        out.extend(group);
    }
    Ok(())
}
