//! `ferrite bench norm`: forward and backward of RMSNorm and LayerNorm, as GB/s against the
//! device copy bandwidth measured in the same run (a norm moves the bytes a copy moves: its
//! ceiling), naive → vectorized.

use super::cuda::{self as nc, BwdPtrs, FwdPtrs};
use super::{variants, vectorized_fits, NormKind, Problem, OP};
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

/// The norms a run times, headline first.
const KINDS: [NormKind; 2] = [NormKind::Rms, NormKind::Layer];

/// Fewest bytes of a pass: forward reads x, writes y (+ w, b, stats); backward reads dy and x,
/// writes dx (+ w, dw, db, stats).
fn bytes(p: &Problem, backward: bool) -> f64 {
    let (n, es) = ((p.rows * p.cols) as f64, p.dtype.size_in_bytes() as f64);
    let params = p.cols as f64 * es * if p.kind == NormKind::Layer { 2.0 } else { 1.0 };
    let stats = p.rows as f64 * 4.0 * if p.kind == NormKind::Layer { 2.0 } else { 1.0 };
    if backward {
        3.0 * n * es + 2.0 * params + stats
    } else {
        2.0 * n * es + params + stats
    }
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
    for [rows, cols] in cfg.shapes_2d(if cfg.quick { [512, 1024] } else { [4096, 1024] }) {
        // Representative: RMSNorm (the README's first norm row), not LayerNorm.
        for &kind in cfg.scope(&KINDS) {
            let p = Problem {
                kind,
                rows,
                cols,
                dtype: DType::F32,
                device: Device::Cpu,
            };
            let x = Tensor::rand(&[rows, cols], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
            let w = Tensor::rand(&[cols], DType::F32, Device::Cpu, 2, 0.5, 1.5)?;
            let y = Tensor::empty(&[rows, cols], DType::F32, Device::Cpu)?;
            let mut group = Vec::new();
            for v in variants()
                .iter()
                .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
            {
                progress(&format!("norm cpu {} {}", v.name, p.label()));
                let opts = super::NormOptions {
                    variant: Some(v.name.into()),
                    ..Default::default()
                };
                let i = super::Fwd {
                    x: &x,
                    residual: None,
                    weight: Some(&w),
                    bias: None,
                };
                let o = super::FwdOut {
                    y: &y,
                    h: None,
                    mean: None,
                    rstd: None,
                };
                let s = time_cpu_op(Budget::cpu(), || super::forward_into(kind, &i, &o, &opts))?;
                let mut r = BenchRecord::new(
                    Device::Cpu,
                    &name,
                    OP,
                    v.name,
                    DType::F32,
                    format!("{} fwd", p.label()),
                    s,
                    0.0,
                    bytes(&p, false),
                );
                r.config = cpu_threads_note(v.name == "parallel");
                group.push(r);
            }
            relate(&mut group, "naive", None);
            out.extend(group);
        }
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
    // Representative: RMSNorm forward, bf16 32768×4096 (the README's first row): no f32, no
    // LayerNorm, no backward.
    for dtype in cfg.dtypes_in_scope(&[DType::BF16, DType::F32]) {
        for [rows, cols] in cfg.shapes_2d(if cfg.quick {
            [4096, 4096]
        } else {
            [32768, 4096]
        }) {
            let x = Tensor::rand(&[rows, cols], dtype, d, 1, -1.0, 2.0)?;
            let dy = Tensor::rand(&[rows, cols], dtype, d, 2, -1.0, 1.0)?;
            let w = Tensor::rand(&[cols], dtype, d, 3, 0.5, 1.5)?;
            let b = Tensor::rand(&[cols], dtype, d, 4, -0.5, 0.5)?;
            let y = Tensor::empty(&[rows, cols], dtype, d)?;
            let dw = Tensor::empty(&[cols], dtype, d)?;
            let db = Tensor::empty(&[cols], dtype, d)?;
            let mean = Tensor::empty(&[rows], DType::F32, d)?;
            let rstd = Tensor::empty(&[rows], DType::F32, d)?;
            for &kind in cfg.scope(&KINDS) {
                let layer = kind == NormKind::Layer;
                let p = Problem {
                    kind,
                    rows,
                    cols,
                    dtype,
                    device: d,
                };
                let fq = FwdPtrs {
                    y: y.device_ptr()?,
                    mean: if layer { mean.device_ptr()? } else { 0 },
                    rstd: rstd.device_ptr()?,
                    x: x.device_ptr()?,
                    w: w.device_ptr()?,
                    b: if layer { b.device_ptr()? } else { 0 },
                    ..Default::default()
                };
                let bq = BwdPtrs {
                    dx: y.device_ptr()?,
                    dw: dw.device_ptr()?,
                    db: if layer { db.device_ptr()? } else { 0 },
                    dy: dy.device_ptr()?,
                    x: x.device_ptr()?,
                    w: w.device_ptr()?,
                    mean: fq.mean,
                    rstd: fq.rstd,
                };
                let runnable: Vec<&str> = variants()
                    .iter()
                    .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
                    .filter(|v| v.name != "vectorized" || vectorized_fits(&p, &[]).is_none())
                    .map(|v| v.name)
                    .collect();
                let mut fwd = Vec::new();
                for v in &runnable {
                    progress(&format!("norm {d} {v} {dtype} {} fwd", p.label()));
                    let geo = nc::fwd_geometry(v, &p, dev, fq, 1e-5, &stream)?;
                    let l = nc::plan_fwd(geo, &p, dev)?;
                    let s = time_gpu(dev, &stream, Budget::gpu(), |_| {
                        nc::launch_fwd(&l, &p, fq, 1e-5, &stream)
                    })?;
                    let mut r = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        v,
                        dtype,
                        format!("{} fwd", p.label()),
                        s,
                        0.0,
                        bytes(&p, false),
                    );
                    r = r.with_kernel(&l.kernel, l.threads, 0)?;
                    r.config = geo.describe(&p);
                    fwd.push(r);
                }
                relate(&mut fwd, "naive", ceiling);
                out.extend(fwd);
                // Representative: the forward alone.
                if cfg.representative {
                    continue;
                }
                let mut bwd = Vec::new();
                for v in runnable.iter().filter(|v| {
                    **v != "vectorized" || super::vectorized_bwd_fits(&p, &[]).is_none()
                }) {
                    progress(&format!("norm {d} {v} {dtype} {} bwd", p.label()));
                    let geo = nc::bwd_geometry(v, &p, dev, bq, &stream)?;
                    let l = nc::plan_bwd(geo, &p, dev)?;
                    let scratch = dev.alloc(nc::bwd_scratch_bytes(&l, &p, &bq), &stream)?;
                    let s = time_gpu(dev, &stream, Budget::gpu(), |_| {
                        nc::launch_bwd(&l, &p, bq, scratch.ptr(), &stream)
                    })?;
                    let mut r = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        v,
                        dtype,
                        format!("{} bwd", p.label()),
                        s,
                        0.0,
                        bytes(&p, true),
                    );
                    r = r.with_kernel(&l.kernel, l.threads, l.smem)?;
                    r.config = format!(
                        "{}; {} blocks, dw/db partials {} rows",
                        geo.describe(&p),
                        l.grid,
                        l.grid
                    );
                    bwd.push(r);
                }
                relate(&mut bwd, "naive", ceiling);
                out.extend(bwd);
            }
        }
    }
    Ok(())
}
