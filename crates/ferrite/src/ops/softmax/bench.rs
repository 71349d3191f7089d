//! `ferrite bench softmax`: forward and backward as GB/s against the device copy bandwidth
//! measured in the same run, naive → vectorized.

use super::cuda as sc;
use super::{variants, Problem, SoftmaxOptions, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu, BenchRecord, Budget,
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

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    // Representative: the same single case (4096×1024 forward, every rung).
    for [r, c] in cfg.shapes_2d(if cfg.quick { [512, 1024] } else { [4096, 1024] }) {
        let x = Tensor::rand(&[r, c], DType::F32, Device::Cpu, 1, -5.0, 5.0)?;
        let y = Tensor::empty(&[r, c], DType::F32, Device::Cpu)?;
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
        {
            progress(&format!("softmax cpu {} {r}×{c}", v.name));
            let opts = SoftmaxOptions {
                variant: Some(v.name.into()),
                ..Default::default()
            };
            let s = time_cpu_op(Budget::cpu(), || super::softmax_into(&x, &y, &opts))?;
            let mut rec = BenchRecord::new(
                Device::Cpu,
                &crate::core::harness::cpu_name(),
                OP,
                v.name,
                DType::F32,
                format!("{r}×{c} fwd"),
                s,
                0.0,
                8.0 * (r * c) as f64,
            );
            rec.config = cpu_threads_note(v.name != "naive");
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
    // Representative: the forward, bf16 32768×4096 (the docs' and README's first row).
    for dtype in cfg.dtypes_in_scope(&[DType::BF16, DType::F32]) {
        for [r, c] in cfg.shapes_2d(if cfg.quick {
            [4096, 4096]
        } else {
            [32768, 4096]
        }) {
            let p = Problem {
                rows: r,
                cols: c,
                dtype,
                device: d,
            };
            let x = Tensor::rand(&[r, c], dtype, d, 1, -5.0, 5.0)?;
            let dy = Tensor::rand(&[r, c], dtype, d, 2, -1.0, 1.0)?;
            let y = Tensor::empty(&[r, c], dtype, d)?;
            let dx = Tensor::empty(&[r, c], dtype, d)?;
            let es = dtype.size_in_bytes() as f64;
            let n = (r * c) as f64;
            for &backward in cfg.scope(&[false, true]) {
                let ptrs = if backward {
                    vec![dx.device_ptr()?, dy.device_ptr()?, y.device_ptr()?]
                } else {
                    vec![y.device_ptr()?, x.device_ptr()?]
                };
                let mut group = Vec::new();
                for v in variants()
                    .iter()
                    .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
                {
                    if v.name == "vectorized"
                        && super::vectorized_unfit(&p, &[], backward).is_some()
                    {
                        continue;
                    }
                    let dir = if backward { "bwd" } else { "fwd" };
                    progress(&format!("softmax {d} {} {dtype} {r}×{c} {dir}", v.name));
                    let l = sc::plan(v.name, &p, backward, dev, &stream, &ptrs, 1.0)?;
                    let s = time_gpu(dev, &stream, Budget::gpu(), |_| {
                        sc::launch(&l, &p, &ptrs, 1.0, &stream)
                    })?;
                    let bytes = n * es * if backward { 3.0 } else { 2.0 };
                    let mut rec = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        v.name,
                        dtype,
                        format!("{r}×{c} {dir}"),
                        s,
                        0.0,
                        bytes,
                    )
                    .with_kernel(&l.kernel, l.threads, 0)?;
                    rec.config = l.config.clone();
                    group.push(rec);
                }
                relate(&mut group, "naive", ceiling);
                out.extend(group);
            }
        }
    }
    Ok(())
}
