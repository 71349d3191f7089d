//! `ferrite bench rotary`: q and k of a packed QKV projection rotated in place (what a Llama
//! layer does), as GB/s against the device copy bandwidth measured in the same run.

use super::check::tables;
use super::cuda as rc;
use super::{rotary_into, validate, variants, RotaryOptions, OP};
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

/// One case per device already (q and k rotated in place, every rung): representative scope runs
/// the same.
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
    let (b, s, h, dim) = (1, if cfg.quick { 256 } else { 2048 }, 8, 128);
    let x = Tensor::rand(&[b, s, h, dim], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
    let (cos, sin) = tables(s, dim / 2, DType::F32, Device::Cpu)?;
    let mut group = Vec::new();
    for v in variants()
        .iter()
        .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
    {
        progress(&format!("rotary cpu {} {b}×{s}×{h}×{dim}", v.name));
        let o = RotaryOptions {
            variant: Some(v.name.into()),
            ..Default::default()
        };
        let st = time_cpu_op(Budget::cpu(), || rotary_into(&x, &cos, &sin, &x, &o))?;
        let mut rec = BenchRecord::new(
            Device::Cpu,
            &crate::core::harness::cpu_name(),
            OP,
            v.name,
            DType::F32,
            format!("{b}×{s}×{h}×{dim} in place"),
            st,
            0.0,
            8.0 * x.numel() as f64,
        );
        rec.config = cpu_threads_note(v.name != "naive");
        group.push(rec);
    }
    relate(&mut group, "naive", None);
    out.extend(group);
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
    // Llama-3-8B-like: 32 query heads and 8 KV heads of 128, tokens = B·S.
    let (b, s, hq, hk, dim) = (if cfg.quick { 2 } else { 8 }, 4096, 32, 8, 128);
    for dtype in [DType::BF16].into_iter().filter(|t| cfg.wants_dtype(*t)) {
        let width = (hq + 2 * hk) * dim;
        let qkv = Tensor::rand(&[b, s, width], dtype, d, 1, -1.0, 1.0)?;
        let (cos, sin) = tables(s, dim / 2, dtype, d)?;
        let view =
            |h: usize, at: usize| qkv.as_strided(&[b, s, h, dim], &[s * width, width, dim, 1], at);
        let (q, k) = (view(hq, 0)?, view(hk, hq * dim)?);
        let o = RotaryOptions::default();
        let (pq, pk) = (
            validate(&q, &cos, &sin, &q, &o)?,
            validate(&k, &cos, &sin, &k, &o)?,
        );
        let ptr = |t: &Tensor| t.device_ptr();
        let (qp, kp, cp, sp) = (ptr(&q)?, ptr(&k)?, ptr(&cos)?, ptr(&sin)?);
        let bytes = 2.0 * ((hq + hk) * b * s * dim * dtype.size_in_bytes()) as f64;
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
        {
            progress(&format!(
                "rotary {d} {} {dtype} q+k of {b}×{s} tokens",
                v.name
            ));
            let (lq, lk) = (rc::plan(v.name, &pq, false)?, rc::plan(v.name, &pk, false)?);
            let st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                rc::launch(&lq, &pq, &o, [qp, qp, cp, sp, 0, 0], &stream)?;
                rc::launch(&lk, &pk, &o, [kp, kp, cp, sp, 0, 0], &stream)
            })?;
            let mut rec = BenchRecord::new(
                d,
                &name,
                OP,
                v.name,
                dtype,
                format!("{b}×{s}×({hq}+{hk})×{dim} q,k in place"),
                st,
                0.0,
                bytes,
            )
            .with_kernel(&lq.kernel, 256, 0)?;
            rec.config = format!("{} blocks", lq.blocks);
            group.push(rec);
        }
        relate(&mut group, "naive", ceiling);
        out.extend(group);
    }
    Ok(())
}
